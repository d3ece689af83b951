"""hydraloop.keyed_attention: attention with keyed dropout, a block of queries at a time, computes what the explicit
attention computes (keyed_dropout on the whole weights), and keeps none of the (batch, heads, T, T) weights."""

import pytest
import torch

from hydraloop.keyed_attention import BLOCK, blocked_keyed_attention
from hydraloop.keyed_dropout import keyed_dropout
from hydraloop.row_keys import RowKeys, current_rows, mix_int

CPU = torch.device("cpu")


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float16, 1e-2)])
def test_blocks_of_queries_give_the_explicit_attention_and_its_gradients(dtype, tolerance):
    """Blocks of 16 over 70 queries (the last one short), a causal mask with padded keys and a query that sees no key
    (the mask's minimum on every score, as transformers' eager mask gives): values and gradients to round-off (in
    float16 too, where the mask's minimum must swamp the scores as it does in the explicit attention)."""
    batch, heads, length, dim, p = 3, 2, 70, 8, 0.3
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator).to(dtype) for _ in range(3))
    allowed = torch.ones(length, length).tril().bool().expand(batch, 1, length, length).clone()
    allowed[1, :, :, 60:] = False  # the second sample's last 10 tokens are padding
    allowed[2, :, 5] = False  # a query that sees nothing
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    key_term = mix_int(12345)

    def attention(blocked: bool):
        inputs = [tensor.clone().requires_grad_() for tensor in (q, k, v)]
        with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(step=4, first_row=0, rows=batch):
            if blocked:
                out = blocked_keyed_attention(*inputs, mask, p, dim**-0.5, *current_rows(), key_term, block=16)
            else:
                scores = inputs[0] @ inputs[1].transpose(-1, -2) * dim**-0.5 + mask
                weights = torch.softmax(scores, dim=-1, dtype=torch.float32 if dtype == torch.float16 else dtype)
                out = keyed_dropout(weights.to(dtype), p, key_term) @ inputs[2]
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view(out.shape).to(dtype))
        return out.detach(), [tensor.grad for tensor in inputs]

    explicit, explicit_grads = attention(blocked=False)
    blocked, blocked_grads = attention(blocked=True)
    torch.testing.assert_close(blocked, explicit, rtol=tolerance, atol=tolerance)
    for got, expected in zip(blocked_grads, explicit_grads):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_a_long_sequence_keeps_no_attention_weights_for_the_backward_pass():
    """A GPT-2 with attention dropout: past 2 x BLOCK tokens nothing of (batch, heads, T, T) is saved for the
    backward pass; at 2 x BLOCK, the explicit attention's weights are. The largest saved is then transformers' own
    additive mask, (batch, 1, T, T), which it builds for every layer's attention whatever computes it."""
    pytest.importorskip("transformers", reason="the hf extra (in dev)")
    from hydraloop.models.hf import hf_model

    heads, batch = 4, 2
    config = {"n_layer": 1, "n_embd": 16, "n_head": heads, "n_positions": 2 * BLOCK + 8, "attn_pdrop": 0.2}
    model = hf_model(model_type="gpt2", config=config, vocab_size=50).train()

    def largest_saved(length: int) -> int:
        ids = torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(1))
        sizes = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t)
        with hooks, RowKeys(seed=0, rank=0, world_size=1, device=CPU)(step=1, first_row=0, rows=batch):
            loss = model(ids, labels=ids).loss
        loss.backward()  # as the loop's: outside its rows
        return max(sizes)

    assert largest_saved(2 * BLOCK) == batch * heads * (2 * BLOCK) ** 2  # explicit: the weights are saved
    long = 2 * BLOCK + 8
    assert largest_saved(long) == batch * long**2  # blocked: the mask, no weights


def test_a_batch_of_several_rows_a_sample_and_a_trained_mask_take_the_explicit_attention():
    """The blocked attention keys a row per sample and gives the mask no gradient: a model that flattens several
    rows a sample into the batch (keyed_dropout accepts a multiple of the rows), or trains its mask, gets the explicit
    attention, at any length."""
    from torch import nn

    from hydraloop.models.hf_keyed_dropout import keyed_attention

    module = nn.Module().train()
    module.keyed_dropout_key = mix_int(7)
    length = 2 * BLOCK + 8
    q, k, v = (torch.randn(4, 2, length, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    trained_mask = torch.zeros(2, 1, length, length, requires_grad=True)
    with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(step=1, first_row=0, rows=2):
        flattened, _ = keyed_attention(module, q, k, v, None, dropout=0.5)  # 4 rows of a batch of 2 samples
        weights = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, dim=-1)
        torch.testing.assert_close(
            flattened, (keyed_dropout(weights, 0.5, module.keyed_dropout_key) @ v).transpose(1, 2)
        )
        out, _ = keyed_attention(module, q[:2], k[:2], v[:2], trained_mask, dropout=0.5)
    out.sum().backward()
    assert trained_mask.grad is not None and trained_mask.grad.abs().sum() > 0
