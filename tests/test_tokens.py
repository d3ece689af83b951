"""data=tokens through the command line: memory-mapped token files (scripts/prepare_text.py's, whose own tests are
tests/test_prepare_text.py) train what data=text trains on the same tokens; random windows are exact under ddp, fsdp,
accumulation and resume; a fixed validation draw is the same under 1 and 2 ranks; memory stays flat in the corpus
size; bad files are one line."""

import json
import math
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, bad_input_line, compose_train, max_param_diff, prepare_tokens, write_random_tokens
from hydraloop.data.text import corpus_path
from hydraloop.data.tokens import RandomWindows, TokenFile, load_tokens
from hydraloop.errors import ConfigError

GPT = (
    "model=gpt",
    "task=language_model",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.block_size=32",
    "data.batch_size=16",
    "trainer.max_steps=8",
    "logger=none",
)


def test_strided_token_files_train_what_data_text_trains_on_the_same_tokens(run_train, char_tokens):
    tokens = run_train(*GPT, "data=tokens", f"data.dataset.dir={char_tokens}", "data.dataset.windows=strided")
    text = run_train(*GPT, "data=text")
    assert tokens.returncode == 0 and text.returncode == 0, tokens.output + text.output
    assert max_param_diff(tokens.checkpoint()["model"], text.checkpoint()["model"]) == 0
    assert tokens.metrics["val/loss"] == text.metrics["val/loss"]
    assert tokens.checkpoint()["config"]["data"]["tokenizer"]["vocab"] == text.checkpoint()["config"]["data"]["vocab"]
    # The same ids either way: a checkpoint of one resumes on the other (data=text's evaluation, here).
    evaluated = run_train(*GPT, "data=text", "mode=eval", f"ckpt_path={tokens.run_dir / 'checkpoints' / 'last.pt'}")
    assert evaluated.returncode == 0, evaluated.output
    assert evaluated.metrics["val/loss"] == pytest.approx(text.metrics["val/loss"], rel=1e-6)


def test_a_nanogpt_folder_with_its_meta_pkl_trains_as_the_same_tokens_with_meta_json(run_train, char_tokens, tmp_path):
    """nanoGPT's char-level prepare.py writes train.bin, val.bin (uint16) and meta.pkl (vocab_size, itos, stoi)."""
    nanogpt = tmp_path / "shakespeare_char"
    nanogpt.mkdir()
    for split in ("train", "val"):
        shutil.copy(char_tokens / f"{split}.bin", nanogpt / f"{split}.bin")
    vocab = json.loads((char_tokens / "meta.json").read_text())["tokenizer"]["vocab"]
    itos = dict(enumerate(vocab))
    meta = {"vocab_size": len(vocab), "itos": itos, "stoi": {c: i for i, c in itos.items()}}
    (nanogpt / "meta.pkl").write_bytes(pickle.dumps(meta))
    runs = [run_train(*GPT, "data=tokens", f"data.dataset.dir={folder}") for folder in (char_tokens, nanogpt)]
    assert all(run.returncode == 0 for run in runs), runs[1].output
    assert max_param_diff(runs[0].checkpoint()["model"], runs[1].checkpoint()["model"]) == 0
    # A pickle that names a function (which unpickling would call) is refused, not run.
    (nanogpt / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 2, "itos": print}))
    line = bad_input_line(run_train(*GPT, "data=tokens", f"data.dataset.dir={nanogpt}", run_dir=tmp_path / "r"))
    assert (
        f"data.dataset.dir={nanogpt}: meta.pkl is not a plain pickle of a vocabulary (it names builtins.print)" in line
    )


def test_random_windows_are_a_function_of_seed_epoch_and_index(char_tokens):
    meta = json.loads((char_tokens / "meta.json").read_text())
    file = TokenFile(char_tokens / "train.bin", meta["dtype"])
    windows = RandomWindows(file, 32, meta["vocab_size"], "here", count=1000, seed=0)
    starts = [windows.start((0, index)) for index in range(1000)]
    assert starts == [RandomWindows(file, 32, 73, "here", 1000, 0).start((0, index)) for index in range(1000)]
    assert starts != [windows.start((1, index)) for index in range(1000)]  # another epoch, other windows
    assert min(starts) >= 0 and max(starts) <= file.length - 33  # a whole window (and its target) each
    # Spread over the file: every tenth of it gets about a tenth of the windows.
    assert np.histogram(starts, bins=10, range=(0, file.length))[0].min() > 60
    x, y = windows[(0, 5)]
    assert x.shape == y.shape == (32,) and (x[1:] == y[:-1]).all()


@pytest.mark.slow
def test_random_windows_are_exact_under_ddp_fsdp_accumulation_and_a_resume(run_train, char_tokens):
    data = ("data=tokens", f"data.dataset.dir={char_tokens}", "data.dataset.val_windows=48")
    single = run_train(*GPT, *data, "trainer.ckpt_every_n_steps=4", "trainer.keep_last_k=3")
    assert single.returncode == 0, single.output
    halfway = single.run_dir / "checkpoints" / "step-00000004.pt"
    runs = {
        "ddp": run_train(*GPT, *data, "parallel=ddp"),
        "fsdp": run_train(*GPT, *data, "parallel=fsdp"),
        "accumulating 4": run_train(*GPT, *data, "trainer.grad_accum_steps=4"),
        "resumed under ddp": run_train(*GPT, *data, "parallel=ddp", f"ckpt_path={halfway}"),
    }
    for name, run in runs.items():
        assert run.returncode == 0, name + run.output
        assert max_param_diff(run.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5, name
        assert run.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-5), name
    # The fixed validation draw: the same 48 windows, and so the same loss, under 1 and 2 ranks.
    last = single.run_dir / "checkpoints" / "last.pt"
    evaluated = {
        ranks: run_train(*GPT, *data, "mode=eval", f"ckpt_path={last}", *parallel)
        for ranks, parallel in ((1, ()), (2, ("parallel=ddp",)))
    }
    assert all(run.returncode == 0 for run in evaluated.values())
    assert evaluated[2].metrics["val/loss"] == pytest.approx(evaluated[1].metrics["val/loss"], rel=1e-6)
    assert evaluated[1].metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-9)


# The run's peak anonymous resident memory, sampled every 10 ms: what the process holds of its own. Pages of the
# mapped token file it has read are page cache, which the kernel drops under pressure (and maps in large folios: a
# window read can map megabytes of it), so they are not counted.
PEAK_ANON = """
import re, subprocess, sys, time
child, peak = subprocess.Popen(sys.argv[1:]), 0
while child.poll() is None:
    try:
        status = open(f"/proc/{child.pid}/status").read()
        peak = max(peak, int(re.search(r"RssAnon:\\s+(\\d+)", status).group(1)))
    except (OSError, AttributeError):
        pass
    time.sleep(0.01)
print("peak", peak)
sys.exit(child.returncode)
"""


@pytest.mark.slow
def test_memory_stays_flat_in_the_corpus_size(run_train, tmp_path):
    """Peak anonymous memory of a run on 64 thousand tokens and on 200 million (400 MB, which data=text would hold
    as 3.2 GB of int64 windows): the same, to within noise."""
    peaks = {}
    for name, count in (("small", 1 << 16), ("large", 200_000_000)):
        folder = write_random_tokens(tmp_path / name, count)
        run = run_train(*GPT, "data=tokens", f"data.dataset.dir={folder}", wrapper=(sys.executable, "-c", PEAK_ANON))
        assert run.returncode == 0, run.output
        peaks[name] = int(run.output.rsplit("peak ", 1)[1].split()[0]) / 1024  # MiB
        shutil.rmtree(folder)
    assert peaks["large"] - peaks["small"] < 40, peaks


def spoiled(folder, tmp_path, how: str):
    """A copy of a prepared folder with one thing wrong."""
    copy = tmp_path / "spoiled"
    shutil.copytree(folder, copy)
    meta = json.loads((copy / "meta.json").read_text())
    if how == "no meta":
        (copy / "meta.json").unlink()
    elif how == "no val":
        (copy / "val.bin").unlink()
    elif how == "odd bytes":
        with (copy / "train.bin").open("ab") as file:
            file.write(b"\0")
    elif how == "ids past the vocabulary":
        (copy / "meta.json").write_text(json.dumps({**meta, "vocab_size": 10}))
    elif how == "a list":
        (copy / "meta.json").write_text("[]")
    elif how == "a tokenizer name":
        (copy / "meta.json").write_text(json.dumps({**meta, "tokenizer": "char"}))
    elif how == "a lost tokenizer":  # a BPE folder whose tokenizer.json is gone
        (copy / "meta.json").write_text(json.dumps({**meta, "tokenizer": {"kind": "bpe", "file": "tokenizer.json"}}))
    elif how == "other files":
        (copy / "meta.json").write_text(json.dumps({**meta, "tokens": {**meta["tokens"], "val": 5}}))
    return copy


SPOILED = [
    ("no meta", "no meta.json (a folder prepared by scripts/prepare_text.py has one;"),
    ("no val", ": no val.bin"),
    ("odd bytes", "train.bin has 754439 bytes, not a whole number of uint16 tokens"),
    ("ids past the vocabulary", "token id 35 at position 0 of train.bin is not below vocab_size=10 (meta.json)"),
    ("other files", "val.bin holds 41914 tokens, meta.json says 5"),
    ("a list", "meta.json holds list, not an object of dtype, vocab_size, tokenizer"),
    ("a tokenizer name", "meta.json has tokenizer='char'; must be an object with a kind"),
    ("a lost tokenizer", "meta.json names the tokenizer tokenizer.json, which is not there (prepare the folder again)"),
]


@pytest.mark.parametrize("how, expected", SPOILED, ids=[row[0] for row in SPOILED])
def test_a_spoiled_token_folder_is_one_line_before_any_rank_starts(run_train, char_tokens, tmp_path, how, expected):
    folder = spoiled(char_tokens, tmp_path, how)
    run = run_train(*GPT, "data=tokens", f"data.dataset.dir={folder}", "parallel=ddp", run_dir=tmp_path / "run")
    assert expected in bad_input_line(run)
    assert "[rank " not in run.output and not (tmp_path / "run").exists()


def test_a_block_longer_than_the_val_split_is_one_line(run_train, tmp_path, train_env):
    text = tmp_path / "short.txt"
    text.write_text("a few words\n" * 20)  # 240 characters: 24 of them val
    assert prepare_tokens(text, tmp_path / "short", env=train_env).returncode == 0
    run = run_train(*GPT, "data=tokens", f"data.dataset.dir={tmp_path / 'short'}", run_dir=tmp_path / "run")
    assert "data.block_size=32: val.bin of" in bad_input_line(run) and not (tmp_path / "run").exists()


def test_more_validation_windows_than_the_split_holds_is_one_line(char_tokens):
    """Drawn with replacement, they would repeat windows to no end: 10**12 of them hung the run."""
    val_tokens = json.loads((char_tokens / "meta.json").read_text())["tokens"]["val"]
    load_tokens(str(char_tokens), 32, val_windows=val_tokens - 32)  # as many draws as there are windows
    with pytest.raises(ConfigError, match=rf"data.dataset.val_windows=10000000: more than the {val_tokens - 32} "):
        load_tokens(str(char_tokens), 32, val_windows=10_000_000)


def test_a_bpe_corpus_trains_samples_with_its_tokenizer_and_refuses_another(run_train, tmp_path, train_env):
    text = tmp_path / "plays.txt"
    text.write_text(corpus_path(None).read_text()[:60_000])
    bpe = tmp_path / "bpe"
    done = prepare_tokens(text, bpe, "--tokenizer", "bpe", "--vocab-size", "400", env=train_env)
    assert done.returncode == 0, done.stderr
    meta = json.loads((bpe / "meta.json").read_text())
    assert meta["vocab_size"] == 400 and meta["tokenizer"]["kind"] == "bpe"
    run = run_train(*GPT, "data=tokens", f"data.dataset.dir={bpe}", "data.block_size=16")
    assert run.returncode == 0, run.output
    assert run.checkpoint()["config"]["model"]["vocab_size"] == 400
    last = run.run_dir / "checkpoints" / "last.pt"
    sample = [sys.executable, str(REPO / "scripts" / "sample.py"), str(last), "--max-new-tokens", "8"]
    sampled = subprocess.run([*sample, "--prompt", "ROMEO:"], capture_output=True, text=True, env=train_env)
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr
    # The corpus prepared again with another vocabulary: a resume and sampling each refuse it in one line.
    again = prepare_tokens(text, bpe, "--tokenizer", "bpe", "--vocab-size", "300", "--overwrite", env=train_env)
    assert again.returncode == 0, again.stderr
    resumed = run_train(*GPT, "data=tokens", f"data.dataset.dir={bpe}", "data.block_size=16", f"ckpt_path={last}")
    assert "was trained on tokens of another bpe tokenizer than" in bad_input_line(resumed)
    refused = subprocess.run(sample, capture_output=True, text=True, env=train_env)
    assert refused.returncode == 2 and "is not the tokenizer it was trained with" in refused.stderr


def test_nanogpts_cpu_recipe_takes_its_first_steps_on_the_bundled_plays(run_train, char_tokens):
    run = run_train(
        "experiment=nanogpt_shakespeare_char_cpu", f"data.dataset.dir={char_tokens}", "trainer.max_steps=120",
        "trainer.val_every_n_steps=null", "logger=none",
    )  # fmt: skip
    assert run.returncode == 0, run.output
    config = run.checkpoint()["config"]
    assert config["model"]["bias"] is False and config["trainer"]["grad_clip_norm"] == 1.0
    assert run.metrics["val/loss"] < 3.0  # past the warm-up, well below the 4.3 of a uniform guess over 73 characters


@pytest.mark.slow
def test_the_complete_works_bpe_recipe_takes_its_first_steps_on_the_bundled_corpus(run_train, train_env, tmp_path):
    """The documented command on the bundled .gz, then experiment=shakespeare_bpe's first steps, under ddp."""
    corpus = REPO / "src" / "hydraloop" / "data" / "corpora" / "shakespeare_complete.txt.gz"
    done = prepare_tokens(corpus, tmp_path / "bpe", "--tokenizer", "bpe", "--vocab-size", "2048", env=train_env)
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    assert meta["vocab_size"] == 2048 and sum(meta["tokens"].values()) > 1_500_000  # 5 MB of text, all read
    run = run_train(
        "experiment=shakespeare_bpe",
        f"data.dataset.dir={tmp_path / 'bpe'}",
        "trainer.max_steps=4",
        "scheduler.warmup_steps=2",
        "data.dataset.val_windows=64",
        "parallel=ddp",
        "logger=none",
    )
    assert run.returncode == 0, run.output
    assert run.metrics["global_step"] == 4 and run.metrics["val/loss"] < math.log(2048) + 0.5


def test_the_gpt2_recipe_takes_its_first_steps_under_ddp_with_accumulation_and_bf16(run_train, token_folder):
    """GPT-2 124M's settings on 2 CPU ranks, but 2 of its 12 layers of 128 of its 768 and 64 of its 1024 positions:
    the first steps (its own width, in bf16 on 2 CPU cores, took 140 s of the suite; the recipe's values are checked
    as composed)."""
    recipe = compose_train("experiment=gpt2_124m", f"data.dataset.dir={token_folder}").model
    assert (recipe.n_layer, recipe.n_embd, recipe.n_head, recipe.block_size) == (12, 768, 12, 1024)
    run = run_train(
        "experiment=gpt2_124m", f"data.dataset.dir={token_folder}", "model.n_layer=2", "data.block_size=64",
        "model.n_embd=128", "model.n_head=4",
        "data.batch_size=10", "data.num_workers=0", "data.dataset.val_windows=4", "trainer.max_steps=2",
        "trainer.compile=false", "scheduler.warmup_steps=1", "parallel.nproc_per_node=2", "logger=none",
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.output
    config = run.checkpoint()["config"]
    assert config["model"]["vocab_size"] == 50304  # GPT-2's 50257 rounded up to a multiple of 64
    assert config["trainer"]["precision"] == "bf16" and config["trainer"]["grad_accum_steps"] == 5
    assert run.metrics["world_size"] == 2 and run.metrics["global_step"] == 2
    assert abs(run.metrics["val/loss"] - np.log(50304)) < 0.5  # random ids: about a uniform guess
