"""data=hf_lm: next-token prediction over padded texts (lines of the plays, tokenized with a tokenizer trained here):
targets skip padding and each text's last position; a token-weighted loss trains the single-process weights under ddp,
accumulation and recomputation, as does a model calling dropout as a function; the export and sample.py use the
data's tokenizer, and a model padded past its tokenizer exports as trained."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, max_param_diff

pytest.importorskip("datasets", reason="the hf extra (in dev)")
from hydraloop.data.hf import load_hf_dataset  # noqa: E402
from hydraloop.huggingface import load_tokenizer  # noqa: E402
from plays import make_play_lines  # noqa: E402


@pytest.fixture(scope="module")
def lines(plays, tmp_path_factory):
    """55 lines of the plays, 1 to 40 tokens long, as a txt file: 49 for training (4 batches of 12, then 1 line:
    fewer than 2 ranks x 2 micro-batches), 6 held out."""
    path = tmp_path_factory.mktemp("lines") / "lines.txt"
    path.write_text("\n".join(line for line, _ in make_play_lines.play_lines()[:55]) + "\n")
    return path


TINY_GPT2 = ("model.model_type=gpt2", "+model.config.n_layer=1", "+model.config.n_embd=32", "+model.config.n_head=2")
TINY_GPT2 += ("+model.config.n_positions=32",)
# OPT calls its dropout as a function (nn.functional.dropout), on its residual branches (0.1 by default).
TINY_OPT = ("model.model_type=opt", "+model.config.hidden_size=32", "+model.config.word_embed_proj_dim=32")
TINY_OPT += ("+model.config.ffn_dim=64", "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=2")
TINY_OPT += ("+model.config.max_position_embeddings=32", "+model.config.attention_dropout=0.1")


def causal_lm(plays, lines, *overrides: str, architecture: tuple[str, ...] = TINY_GPT2) -> list[str]:
    _, tokenizer = plays
    return [
        *["data=hf_lm", f"data.dataset.path={lines}", f"data.dataset.tokenizer={tokenizer}"],
        *["data.dataset.pad_token='<pad>'", "data.batch_size=12", "data.block_size=32", "data.drop_last=false"],
        *["model=hf", *architecture, "task=language_model", "logger=csv"],
        # SGD: see tests/test_hf_data.py's classifier()
        *["optimizer=sgd", "optimizer.lr=0.5", "trainer.max_epochs=1", *overrides],
    ]


def test_next_token_targets_skip_padding_and_each_texts_last_position(plays, lines, tmp_path):
    _, tokenizer = plays
    common = dict(num_classes=None, label_column=None, pad_token="<pad>", max_length=32, cache_dir=str(tmp_path))
    train, val = load_hf_dataset(str(lines), str(tokenizer), **common)
    assert (len(train), len(val)) == (49, 6)
    samples = [train[i] for i in range(4)]
    batch = train.collate_fn(samples)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        assert batch["labels"][row, : length - 1].tolist() == sample["input_ids"][1:].tolist()
        assert (batch["labels"][row, length - 1 :] == -100).all()  # the last position and the padding
    assert len({len(sample["input_ids"]) for sample in samples}) > 1  # the batch was padded


@pytest.fixture(scope="module")
def lm_single(run_train, plays, lines):
    run = run_train(*causal_lm(plays, lines))
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [
            "parallel=ddp",
            "parallel.nproc_per_node=2",
            "trainer.grad_accum_steps=2",
            "model.gradient_checkpointing=true",
        ],
        ["trainer.grad_accum_steps=4"],
    ],
    ids=["ddp-accum-recompute", "accum"],
)
def test_a_token_weighted_loss_over_padded_texts_trains_the_single_process_weights(
    run_train, plays, lines, lm_single, overrides
):
    """Micro-batches hold different numbers of tokens: weighting them by rows would train other weights. The last
    batch of 1 line leaves 3 of the 4 micro-batches empty, under ddp rank 1 without a row. Layers recomputed in the
    backward pass (model.gradient_checkpointing) draw the dropout masks of their forward pass."""
    split = run_train(*causal_lm(plays, lines, *overrides))
    assert split.returncode == 0, split.output
    assert max_param_diff(split.checkpoint()["model"], lm_single.checkpoint()["model"]) < 1e-5
    assert split.metrics["val/loss"] == pytest.approx(lm_single.metrics["val/loss"], rel=1e-5)
    assert split.metrics["val/ppl"] == pytest.approx(lm_single.metrics["val/ppl"], rel=1e-5)
    assert split.checkpoint()["global_step"] == lm_single.checkpoint()["global_step"] == 5


@pytest.mark.slow
def test_dropout_called_as_a_function_trains_the_single_process_weights(run_train, plays, lines):
    """OPT's dropout is nn.functional.dropout, keyed by its calls' order in the forward pass: the same calls under
    every split (ddp with accumulation), and in a block recomputed in the backward pass
    (trainer.activation_checkpointing)."""
    single = run_train(*causal_lm(plays, lines, architecture=TINY_OPT))
    assert single.returncode == 0, single.output
    split_recomputed = ["parallel=ddp", "parallel.nproc_per_node=2", "trainer.grad_accum_steps=2"]
    split_recomputed.append("trainer.activation_checkpointing=true")
    split = run_train(*causal_lm(plays, lines, *split_recomputed, architecture=TINY_OPT))
    assert "not equal single-process training" not in split.output
    assert max_param_diff(split.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
    assert split.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_export_and_sampling_use_the_datas_tokenizer(plays, lm_single, train_env, tmp_path):
    """data=hf's ids are its tokenizer's, not bytes: the export carries that tokenizer, padding token and all, and
    sample.py encodes a prompt and decodes the ids with it."""
    transformers = pytest.importorskip("transformers")
    _, tokenizer_file = plays
    data_tokenizer = load_tokenizer(str(tokenizer_file), "<pad>")
    checkpoint = str(lm_single.run_dir / "checkpoints" / "last.pt")
    out = tmp_path / "exported"
    export = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export_hf.py"), checkpoint, str(out)],
        env=train_env,
        capture_output=True,
        text=True,
    )
    assert export.returncode == 0, export.stderr
    exported = transformers.AutoTokenizer.from_pretrained(out)
    line = "To be, or not to be: that is the question"
    assert exported(line)["input_ids"] == data_tokenizer(line)["input_ids"]
    assert (len(exported), exported.pad_token) == (300, "<pad>")

    command = [sys.executable, str(REPO / "scripts" / "sample.py"), checkpoint, "--prompt", "To be"]
    sample = subprocess.run([*command, "--max-new-tokens", "5"], env=train_env, capture_output=True, text=True)
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("To be")


@pytest.fixture(scope="module")
def padded_gpt2(plays, tmp_path_factory):
    """A pretrained folder whose embeddings are padded past its tokenizer, as Pythia's and Qwen's are: a tiny GPT-2
    of 320 rows, saved with the plays' 300-token tokenizer."""
    transformers = pytest.importorskip("transformers")
    _, tokenizer_file = plays
    folder = tmp_path_factory.mktemp("padded_gpt2")
    config = transformers.GPT2Config(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_positions=32)
    config.bos_token_id = config.eos_token_id = None  # GPT-2's 50256 is past these 320
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), pad_token="<pad>").save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_model_padded_past_its_tokenizer_exports_as_trained(padded_gpt2, lines, run_train, train_env, tmp_path):
    """Fine-tuned from a folder of 320 embeddings and a 300-token tokenizer: the export has the 320 rows training
    read and wrote (not the data's 300, which fresh weights would be sized for), the checkpoint's logits, and the
    tokenizer the data was encoded with."""
    transformers = pytest.importorskip("transformers")
    run = run_train(
        *["data=hf_lm", f"data.dataset.path={lines}", "data.batch_size=12", "data.block_size=32"],
        *["model=hf", f"model.name_or_path={padded_gpt2}", "task=language_model", "trainer.max_steps=2"],
        *["optimizer=sgd", "optimizer.lr=0.5", "logger=none"],
    )
    assert run.returncode == 0, run.output
    out = tmp_path / "exported"
    command = [sys.executable, str(REPO / "scripts" / "export_hf.py"), str(run.run_dir / "checkpoints" / "last.pt")]
    export = subprocess.run([*command, str(out)], env=train_env, capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    trained = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(padded_gpt2)).eval()
    trained.load_state_dict(run.checkpoint()["model"])
    assert exported.config.vocab_size == 320
    assert max_param_diff(exported.state_dict(), run.checkpoint()["model"]) == 0.0
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    tokenizer, trained_with = (transformers.AutoTokenizer.from_pretrained(folder) for folder in (out, padded_gpt2))
    line = "To be, or not to be: that is the question"
    assert tokenizer(line)["input_ids"] == trained_with(line)["input_ids"] and len(tokenizer) == 300
    assert tokenizer.get_vocab() == trained_with.get_vocab() and tokenizer.pad_token == "<pad>"
