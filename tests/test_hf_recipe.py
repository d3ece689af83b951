"""experiment=hf_pretrain then experiment=hf_finetune, start to end and offline, at tiny sizes, through the documented
commands: a BPE with an end-of-text token trained here, a GPT-2 pretrained on it, exported, fine-tuned as a
classifier of which play a line is from, starting from the export's weights."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

pytest.importorskip("transformers", reason="the hf extra (in dev)")

pytestmark = pytest.mark.slow

TINY = ["model.config.n_layer=1", "model.config.n_embd=16", "model.config.n_head=2", "logger=csv"]


def script(name: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / f"{name}.py"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_pretrain_export_then_fine_tune_from_the_export(run_train, train_env, tmp_path):
    tokens = tmp_path / "tokens"
    corpus = REPO / "src" / "hydraloop" / "data" / "corpora" / "shakespeare.txt"
    prepared = script(
        "prepare_text", str(corpus), str(tokens), "--tokenizer", "bpe", "--vocab-size", "300",
        "--special-tokens", "<|endoftext|>", env=train_env,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    added = json.loads((tokens / "tokenizer.json").read_text())["added_tokens"]
    assert [(token["id"], token["content"]) for token in added] == [(0, "<|endoftext|>")]
    assert 0 not in np.fromfile(tokens / "train.bin", dtype=np.uint16)  # never made from text

    pretrain = run_train(
        "experiment=hf_pretrain",
        f"data.dataset.dir={tokens}",
        *TINY,
        "trainer.max_steps=4",
        "scheduler.warmup_steps=2",
        "seed=1",
    )
    assert pretrain.returncode == 0, pretrain.output
    export = tmp_path / "gpt2"
    exported = script("export_hf", str(pretrain.run_dir / "checkpoints" / "last.pt"), str(export), env=train_env)
    assert exported.returncode == 0, exported.stderr

    lines = tmp_path / "play_lines.csv"
    assert script("make_play_lines", str(lines), env=train_env).returncode == 0
    finetune = ["experiment=hf_finetune", f"data.dataset.path={lines}", f"model.name_or_path={export}", "logger=csv"]
    finetune += ["scheduler.warmup_steps=0"]
    first_step = run_train(*finetune, "trainer.max_steps=1", "data.batch_size=8")
    assert first_step.returncode == 0, first_step.output
    pretrained = pretrain.checkpoint()["model"]["transformer.wte.weight"]
    tuned = first_step.checkpoint()["model"]
    # One AdamW step of lr 3e-4 from the export's embeddings: the same weights, nearly; a fresh start, far.
    assert (tuned["transformer.wte.weight"] - pretrained).abs().max() < 1e-3
    assert tuned["score.weight"].shape == (3, 16) and "val/f1" in first_step.metrics
    # The pretraining started from another seed's weights than a fresh start of this run (seed 0) does.
    fresh = run_train(*finetune, "model.from_config=true", "trainer.max_steps=1", "data.batch_size=8")
    assert fresh.returncode == 0, fresh.output
    assert (fresh.checkpoint()["model"]["transformer.wte.weight"] - pretrained).abs().max() > 1e-2
