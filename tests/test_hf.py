"""model=hf: a transformers model trains under every strategy to the same weights, dropout on (keyed), resumes
exactly, and refuses what it cannot build in one line; LoRA adapters through peft. The models are tiny GPT-2s built
from a config: no download. Past 300 lines by the adapters' tests, which share its models and runs."""

import importlib.util
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate

from conftest import REPO, bad_input_line, max_param_diff
from hydraloop.data.codec import Codec
from hydraloop.errors import BAD_INPUT_EXIT_CODE, ConfigError

transformers = pytest.importorskip("transformers", reason="the hf extra (in dev)")

pytestmark = pytest.mark.slow

# GPT-2's own dropout settings (0.1 on the embeddings, the attention weights and each residual branch): all keyed.
TINY_GPT2 = [
    "data=text",
    "task=language_model",
    "model=hf",
    "model.model_type=gpt2",
    "+model.config.n_layer=1",
    "+model.config.n_embd=16",
    "+model.config.n_head=2",
    "+model.config.n_positions=32",
    "data.block_size=16",
    "data.batch_size=8",
    "trainer.max_steps=6",
    "logger=csv",
]
TOLERANCE = 1e-5  # float round-off: ranks' and micro-batches' mean gradients summed in another order


@pytest.fixture(scope="module")
def single(run_train):
    run = run_train(*TINY_GPT2)
    assert run.returncode == 0, run.output
    assert "nn.Dropout" not in run.output  # no warning: its dropout is keyed
    return run


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel=ddp", "parallel.nproc_per_node=2"],
        ["parallel=fsdp", "parallel.nproc_per_node=2"],
        ["trainer.grad_accum_steps=4"],
    ],
    ids=["ddp", "fsdp", "accumulation"],
)
def test_a_split_batch_trains_the_single_process_weights_with_dropout_on(run_train, single, overrides):
    split = run_train(*TINY_GPT2, *overrides)
    assert split.returncode == 0, split.output
    assert max_param_diff(split.checkpoint()["model"], single.checkpoint()["model"]) < TOLERANCE
    assert split.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-5)


def test_torchs_dropout_is_not_exact_and_the_launcher_says_so(run_train, single):
    plain = run_train(*TINY_GPT2, "model.keyed_dropout=false", "trainer.grad_accum_steps=4")
    assert plain.returncode == 0, plain.output
    assert "the model has nn.Dropout, whose masks depend on how the batch is split" in plain.output
    assert max_param_diff(plain.checkpoint()["model"], single.checkpoint()["model"]) > 1e-3


def test_stopped_then_rerun_equals_uninterrupted(run_train, single):
    first = run_train(*TINY_GPT2, "trainer.max_steps=3")
    assert first.returncode == 0, first.output
    resumed = run_train(*TINY_GPT2, f"ckpt_path={first.run_dir}/checkpoints/last.pt")
    assert resumed.returncode == 0, resumed.output
    checkpoint = resumed.checkpoint()
    assert max_param_diff(checkpoint["model"], single.checkpoint()["model"]) < 1e-6
    # GPT-2 ties its output layer to the token embedding; the checkpoint's two keys must still be one tensor's values.
    assert torch.equal(checkpoint["model"]["lm_head.weight"], checkpoint["model"]["transformer.wte.weight"])


# LoRA on the tiny GPT-2, its own dropout off: what dropout there is is LoRA's, on each adapter's input.
LORA = [
    *TINY_GPT2,
    "+model.config.resid_pdrop=0",
    "+model.config.embd_pdrop=0",
    "+model.config.attn_pdrop=0",
    "trainer.limit_val_batches=2",
]


def lora(dropout: float) -> str:
    return f"model.lora={{r: 4, alpha: 8, dropout: {dropout}, target_modules: [c_attn, c_fc]}}"


def test_lora_trains_its_adapters_alone_with_keyed_dropout(run_train, train_env, tmp_path):
    """The weights LoRA freezes end as they started, to the bit; its dropout is on (another end than without) and
    keyed (ddp ends where single does). Every other strategy, the uneven last batch and the resume: test_matrix.py's
    gpt2_lora cases, and scripts/check_exact.py's table in docs/make-it-yours.md."""
    from hydraloop.seeding import seed_everything

    single = run_train(*LORA, lora(0.1))
    assert single.returncode == 0, single.output
    trained = single.checkpoint()
    seed_everything(trained["config"]["seed"])  # as each rank builds it (hydraloop.build)
    start = instantiate(trained["config"]["model"]).state_dict()
    adapters = [key for key in start if ".lora_" in key]
    assert len(adapters) == 4 and len(trained["optimizer"]["param_groups"][0]["params"]) == 4
    for key, value in start.items():
        if key not in adapters:
            assert torch.equal(trained["model"][key], value), key
    assert min((trained["model"][key] - start[key]).abs().max() for key in adapters) > 1e-4
    # Exported, the adapters are merged into a plain GPT-2 that gives the checkpoint's logits (export_hf checks them).
    command = [sys.executable, str(REPO / "scripts" / "export_hf.py"), str(single.run_dir / "checkpoints" / "last.pt")]
    export = subprocess.run([*command, str(tmp_path / "merged")], env=train_env, capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "GPT2LMHeadModel" and not any("lora" in key for key in merged.state_dict())
    without_dropout = run_train(*LORA, lora(0.0))
    assert without_dropout.returncode == 0, without_dropout.output
    assert max_param_diff(without_dropout.checkpoint()["model"], trained["model"]) > 1e-4
    ddp = run_train(*LORA, lora(0.1), "parallel=ddp", "parallel.nproc_per_node=2")
    assert ddp.returncode == 0, ddp.output
    assert max_param_diff(ddp.checkpoint()["model"], trained["model"]) < TOLERANCE


def test_bad_lora_settings_are_one_line_before_any_rank_starts(run_refused):
    line = bad_input_line(run_refused(*LORA, "model.lora={r: 4, target_modules: [c_atn]}", "parallel=ddp"))
    expected = "model.lora.target_modules=['c_atn']: peft cannot adapt GPT2LMHeadModel: Target modules {'c_atn'} not"
    assert expected in line and "(its layers LoRA can adapt are named c_attn)" in line


RECOMPUTED = {  # tiny models with their dropout on: all of GPT-2's is in modules, all of OPT's in function calls
    "gpt2": ("AutoModelForCausalLM", "gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32}),
    "gpt2-classifier": (
        "AutoModelForSequenceClassification",
        "gpt2",
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "pad_token_id": 0},
    ),
    "opt": (
        "AutoModelForCausalLM",
        "opt",
        {
            "hidden_size": 32,
            "word_embed_proj_dim": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 32,
            "dropout": 0.1,
            "attention_dropout": 0.1,
        },
    ),
}


@pytest.mark.parametrize("name", list(RECOMPUTED))
def test_recomputed_layers_give_the_gradients_of_one_forward_pass(name):
    """model.gradient_checkpointing (transformers' checkpoint) and trainer.activation_checkpointing (hydraloop's)
    recompute each layer in the backward pass, where the loop has set no rows (the keyed masks, and the count of
    functional dropout calls, must be the forward's) and a cache of keys and values would grow a second time."""
    from hydraloop.activation_checkpointing import checkpoint_activations, checkpointed_classes
    from hydraloop.models.hf import hf_model
    from hydraloop.row_keys import RowKeys

    auto_class, model_type, config = RECOMPUTED[name]
    ids = torch.randint(1, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 0]) if "Classification" in auto_class else ids

    def gradients(recompute: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = hf_model(
            auto_class,
            model_type=model_type,
            config=config,
            num_labels=3,
            vocab_size=50,
            gradient_checkpointing=recompute == "model.gradient_checkpointing",
        ).train()
        if recompute == "trainer.activation_checkpointing":
            checkpoint_activations(model, checkpointed_classes(True, model))
        with RowKeys(seed=0, rank=0, world_size=1, device=torch.device("cpu"))(3, 0, len(ids)):
            loss = model(ids, labels=labels).loss
        loss.backward()  # as the loop's: outside its rows
        return [parameter.grad for parameter in model.parameters()]

    once = gradients(None)
    for recompute in ("model.gradient_checkpointing", "trainer.activation_checkpointing"):
        assert all(torch.equal(a, b) for a, b in zip(once, gradients(recompute))), recompute


def test_a_save_pretrained_folder_loads_with_its_weights(tmp_path):
    from hydraloop.models.hf import hf_model

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=50)
    saved = transformers.GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path / "gpt")
    loaded = hf_model(name_or_path=str(tmp_path / "gpt"), block_size=32, vocab_size=40)
    assert max_param_diff(loaded.state_dict(), saved.state_dict()) == 0.0
    fresh = hf_model(name_or_path=str(tmp_path / "gpt"), from_config=True, config={"n_layer": 2})
    assert len(fresh.transformer.h) == 2 and fresh.config.vocab_size == 50


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sampling_is_seeded_and_keyed_attention_generates_as_transformers_own(single, train_env, one_thread):
    command = [sys.executable, str(REPO / "scripts" / "sample.py"), str(single.run_dir / "checkpoints" / "last.pt")]
    command += ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--num-samples", "2"]
    texts = [subprocess.run(command, env=train_env, capture_output=True, text=True) for _ in range(2)]
    assert texts[0].returncode == 0, texts[0].stderr
    first, second = texts[0].stdout.split("\n---------------\n")
    assert first.startswith("ROMEO:") and len(first) == len("ROMEO:") + 20 and first != second
    assert texts[1].stdout == texts[0].stdout
    too_long = subprocess.run([*command[:3], "--max-new-tokens", "40"], env=train_env, capture_output=True, text=True)
    assert too_long.returncode == BAD_INPUT_EXIT_CODE and "more than the model's 32 positions" in too_long.stderr
    # Generation reads a cache of keys and values: the keyed attention must attend as transformers' sdpa does.
    checkpoint = single.checkpoint()
    prompt = torch.tensor([[5, 6, 7]])
    greedy = []
    for keyed in (True, False):
        model = instantiate(checkpoint["config"]["model"], keyed_dropout=keyed)
        model.load_state_dict(checkpoint["model"])
        greedy.append(script("sample").hf_generate(model.eval(), prompt, 20, temperature=0.0, top_k=0))
    assert model.config._attn_implementation == "sdpa" and torch.equal(greedy[0], greedy[1])


def test_an_export_loads_with_from_pretrained_with_the_checkpoints_weights_and_tokenizer(single, train_env, tmp_path):
    out = tmp_path / "exported"
    command = [sys.executable, str(REPO / "scripts" / "export_hf.py"), str(single.run_dir / "checkpoints" / "last.pt")]
    export = subprocess.run([*command, str(out)], env=train_env, capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert max_param_diff(model.state_dict(), single.checkpoint()["model"]) == 0.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    line = "ROMEO: But, soft! what light\nthrough yonder window breaks?"
    codec = Codec(single.checkpoint()["config"]["data"], "test")
    assert tokenizer(line)["input_ids"] == codec.encode(line, where="test").tolist()
    assert tokenizer.decode(tokenizer(line)["input_ids"]) == line
    again = subprocess.run([*command, str(out)], env=train_env, capture_output=True, text=True)
    assert again.returncode == BAD_INPUT_EXIT_CODE and "nothing is overwritten" in again.stderr


def test_bytes_export_as_a_tokenizer_of_one_byte_per_token():
    tokenizer = script("export_hf").as_transformers_tokenizer(Codec({"vocab": None}, "test"), transformers)
    text = "naïve café\n\tend"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"auto_class": "AutoModelForCausalLm", "model_type": "gpt2"}, "closest: AutoModelForCausalLM"),
        ({"model_type": "gtp2"}, "model.model_type=gtp2: not a transformers model type; closest: gpt2"),
        ({}, "give a folder or cached name, or a model_type"),
        ({"model_type": "gpt2", "config": {"n_layers": 2}}, "model.config.n_layers: not a setting of GPT2Config"),
        ({"model_type": "gpt2", "block_size": 2048}, "data.block_size=2048: longer than the model's 1024 positions"),
        ({"name_or_path": "someone/no-such-gpt"}, "not a local folder, and not in the Hugging Face cache"),
        ({"name_or_path": "/nowhere/gpt"}, "model.name_or_path=/nowhere/gpt: no such folder"),
        ({"model_type": "gpt2", "max_length": 2048}, "data.dataset.max_length=2048: longer than the model's 1024"),
        (
            {"model_type": "gpt2", "auto_class": "AutoModelForMaskedLM", "config": {"n_layer": 1}},
            "model.auto_class=AutoModelForMaskedLM, model.config.n_layer=1: transformers cannot build the "
            "model: Unrecognized configuration class",
        ),
        ({"name_or_path": "CONFIG_ONLY"}, "the folder has a config.json but no weights (model.safetensors"),
        ({"model_type": "gpt2", "lora": {"r": 0}}, "model.lora.r=0: must be a positive integer"),
        (
            {"model_type": "gpt2", "lora": {"dropuot": 0.1}},
            "model.lora.dropuot: not a LoRA setting (did you mean dropout?)",
        ),
        ({"model_type": "gpt2", "lora": {"dropout": 1.0}}, "model.lora.dropout=1.0: must be in [0, 1)"),
        ({"model_type": "gpt2", "lora": {"alpha": -1}}, "model.lora.alpha=-1: must be a positive number"),
        ({"model_type": "gpt2", "lora": {"target_modules": "c_attn"}}, "model.lora.target_modules=c_attn: must be"),
        (
            {"model_type": "gpt2", "lora": {"target_modules": ["mlp"]}},
            "model.lora.target_modules=['mlp']: peft cannot adapt GPT2LMHeadModel:",
        ),
    ],
)
def test_what_it_cannot_build_is_one_line(arguments, expected, tmp_path):
    from hydraloop.models.hf import hf_model

    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)  # a config, no weights
    arguments = {key: str(tmp_path) if value == "CONFIG_ONLY" else value for key, value in arguments.items()}
    with torch.device("meta"), pytest.raises(ConfigError) as error:
        hf_model(**arguments)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    """As on a machine without the extras: find_spec finds none of their packages."""
    import importlib.util

    from hydraloop.huggingface import import_datasets, import_transformers
    from hydraloop.metrics import MetricSet
    from hydraloop.models.hf_lora import import_peft
    from hydraloop.models.timm_model import import_timm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in EXTRAS else real(name, *a))
    for load, extra in (
        (import_transformers, "hf"),
        (import_datasets, "hf"),
        (import_timm, "timm"),
        (import_peft, "peft"),
        (lambda: MetricSet({"f1": {"_target_": "torchmetrics.F1Score"}}, torch.device("cpu")), "metrics"),
    ):
        with pytest.raises(ConfigError, match=rf"pip install 'hydraloop\[{extra}\]'"):
            load()


EXTRAS = ("transformers", "datasets", "timm", "torchmetrics", "peft")


def test_a_lora_classifier_trains_its_fresh_head_in_full():
    from hydraloop.models.hf import hf_model

    config = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32, "pad_token_id": 0}
    model = hf_model("AutoModelForSequenceClassification", model_type="gpt2", config=config, num_labels=3, lora={})
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    adapted = "base_model.model.transformer.h.0.attn.c_attn"  # peft's default for GPT-2: its attention's c_attn
    head = "base_model.model.score.modules_to_save.default.weight"  # peft's trainable copy of the head
    assert trained == [f"{adapted}.lora_A.default.weight", f"{adapted}.lora_B.default.weight", head]
