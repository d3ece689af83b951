"""model=gpt: causal, tied, initialised as GPT-2, FLOPs counted by hand, reproducible sampling, compilable."""

import math

import pytest
import torch
from torch.nn import functional as F

from hydraloop.errors import ConfigError
from hydraloop.models.gpt import GPT, Block

TINY = dict(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(**{**TINY, **overrides})


def tokens(batch: int = 2, time: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(TINY["vocab_size"], (batch, time), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_and_too_long_sequence():
    model = tiny_gpt()
    assert model(tokens(3, 16)).shape == (3, 16, 11)
    assert model(tokens(3, 5)).shape == (3, 5, 11)
    with pytest.raises(ValueError, match=r"^GPT: a sequence of 17 tokens is longer than model.block_size=16$"):
        model(tokens(1, 17))


def test_future_tokens_do_not_change_past_logits():
    model = tiny_gpt().eval()
    idx = tokens(2, 16)
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 11
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9])
    assert (before[:, 9:] - after[:, 9:]).abs().max() > 1e-3  # the changed positions themselves do change


def test_output_head_is_the_token_embedding():
    model = tiny_gpt().eval()
    assert [name for name, _ in model.named_parameters() if "embedding" in name] == [
        "token_embedding.weight",
        "position_embedding.weight",
    ]
    assert not any(isinstance(module, torch.nn.Linear) and module.out_features == 11 for module in model.modules())
    idx = tokens(1, 16)
    hidden = {}
    model.final_norm.register_forward_hook(lambda module, args, output: hidden.update(h=output))
    logits = model(idx)
    torch.testing.assert_close(logits, hidden["h"] @ model.token_embedding.weight.T)
    # One Parameter: a step on the head moves the embedding (and an optimizer sees it once).
    model.token_embedding.weight.grad = None
    logits[0, -1, 3].backward()
    assert model.token_embedding.weight.grad[3].abs().sum() > 0


def test_every_parameter_gets_a_gradient():
    """DDP's default find_unused_parameters=false needs every parameter in every step's graph."""
    model = tiny_gpt(dropout=0.1)
    idx = tokens(2, 16)
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_gpt2_initialisation():
    model = tiny_gpt(n_layer=4, n_embd=128, vocab_size=65, block_size=64)
    params = dict(model.named_parameters())
    residual = torch.cat([p.flatten() for name, p in params.items() if name.endswith("out_proj.weight")])
    others = torch.cat([p.flatten() for name, p in params.items() if name.endswith(("qkv.weight", "fc.weight"))])
    assert len(residual) == 4 * (128 * 128 + 512 * 128)
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.02)
    assert others.std().item() == pytest.approx(0.02, rel=0.02)
    assert params["token_embedding.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["position_embedding.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    for name, p in params.items():
        if name.endswith(".bias"):
            assert p.abs().max().item() == 0, name
        elif "norm" in name:
            assert p.eq(1).all(), name


def test_parameter_count_and_flops_per_token_by_hand():
    # C = 32, V = 11, L = 2. Per block: two LayerNorms 4C, qkv 3C^2 + 3C, attention out C^2 + C, MLP in
    # 4C^2 + 4C, MLP out 4C^2 + C: 12C^2 + 13C = 12704. Token embedding (= output head) VC = 352, final norm 2C = 64.
    model = tiny_gpt()
    assert model.num_params() == 352 + 2 * 12704 + 64 == 25824
    assert model.num_params(non_embedding=False) == 25824 + 16 * 32  # plus the position embedding
    # 6N, plus attention's 12 * L * C * T at T = 16: 6 * 25824 + 12 * 2 * 32 * 16.
    assert model.flops_per_token(16) == 154944 + 12288 == 167232
    assert model.flops_per_token(8) == 154944 + 6144
    # Without biases: per block 12C^2 + 2C (LayerNorm weights only), final norm C.
    assert tiny_gpt(bias=False).num_params() == 352 + 2 * (12 * 32 * 32 + 64) + 32


def test_generate_is_reproducible_with_a_seed():
    model = tiny_gpt()
    prompt = tokens(1, 3)

    def sample(seed: int, **kwargs) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 40, generator=generator, **kwargs)[0].tolist()

    first = sample(5)
    assert len(first) == 43 and first[:3] == prompt[0].tolist()  # longer than block_size: the context is cropped
    assert sample(5) == first
    assert sample(6) != first
    assert sample(5, top_k=1) == sample(6, top_k=1) == sample(7, temperature=0)  # top-1 is greedy


def test_generate_samples_only_from_the_top_k():
    model = tiny_gpt()
    generated = model.generate(tokens(4, 1), 15, top_k=3, generator=torch.Generator().manual_seed(0))
    assert generated.shape == (4, 16)
    # Whole sequence within block_size: one causal forward gives every step's logits.
    top3 = model(generated[:, :-1]).topk(3, dim=-1).indices
    assert (top3 == generated[:, 1:, None]).any(dim=-1).all()
    unrestricted = model.generate(tokens(4, 1), 15, generator=torch.Generator().manual_seed(0))
    assert not (model(unrestricted[:, :-1]).topk(3, dim=-1).indices == unrestricted[:, 1:, None]).any(-1).all()


def test_generate_runs_in_eval_mode_and_restores_training():
    model = tiny_gpt(dropout=0.5).train()
    prompt = tokens(1, 4)
    assert model.generate(prompt, 8, temperature=0).tolist() == model.generate(prompt, 8, temperature=0).tolist()
    assert model.training
    with pytest.raises(ValueError, match=r"^temperature=-1: must be >= 0 \(0: greedy\)$"):
        model.generate(prompt, 1, temperature=-1)
    with pytest.raises(ValueError, match=r"^top_k=0: must be a positive integer, or None for no limit$"):
        model.generate(prompt, 1, top_k=0)


def test_bf16_autocast_forward_is_close_to_float32():
    model = tiny_gpt().eval()
    idx = tokens(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(idx)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), model(idx), atol=0.05, rtol=0.05)


def test_builds_on_the_meta_device_with_blocks_as_shard_units():
    """parallel=fsdp checks shard_modules against a model built on the meta device, and shards each Block."""
    with torch.device("meta"):
        model = GPT(**TINY)
    names = {type(module).__name__ for module in model.modules()}
    assert set(GPT._no_split_modules) <= names
    assert sum(isinstance(module, Block) for module in model.modules()) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(n_embd=30), "model.n_embd=30: must be divisible by model.n_head=4"),
        (dict(vocab_size=None), "model.vocab_size=None: must be a positive integer (data=text sets data.vocab_size)"),
        (dict(block_size=0), "model.block_size=0: must be a positive integer (data=text sets data.block_size)"),
        (dict(n_layer=0), "model.n_layer=0: must be positive"),
        (dict(dropout=1.0), "model.dropout=1.0: must be in [0, 1)"),
    ],
)
def test_bad_model_config(overrides, message):
    with pytest.raises(ConfigError) as error:
        GPT(**{**TINY, **overrides})
    assert str(error.value) == message


@pytest.mark.slow
def test_compiled_forward_matches_eager():
    model = tiny_gpt().eval()
    idx = tokens(2, 16)
    eager = model(idx)
    model.compile()  # in place, as trainer.compile does: the state_dict keys stay the plain model's
    torch.testing.assert_close(model(idx), eager, atol=1e-5, rtol=1e-5)
    assert "token_embedding.weight" in model.state_dict()
