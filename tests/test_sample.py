"""scripts/sample.py: rebuilds a language model from a checkpoint's own config, decodes with the vocabulary stored
there, and gives the same text for the same seed.

Until the loop trains language models, the checkpoints here are written by hand in the loop's format: `model` (the
state_dict) and `config` (the resolved config as plain values, composed from the real yaml files)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import REPO
from hydraloop.config import register_configs
from hydraloop.errors import BAD_INPUT_EXIT_CODE

SCRIPT = REPO / "scripts" / "sample.py"
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune\n" * 4

spec = importlib.util.spec_from_file_location("sample_script", SCRIPT)
sample_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sample_script)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def checkpoint(tmp_path):
    """checkpoint(level="char") -> path of a checkpoint of a tiny, untrained GPT for a small text file."""

    def write(level: str = "char", *extra: str) -> str:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text(TEXT)
        register_configs()
        overrides = ["data=text", "model=gpt", f"data.dataset.path={corpus}", f"data.dataset.level={level}"]
        overrides += ["data.block_size=16", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", *extra]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}", f"log_file={tmp_path}/log"])
        config = OmegaConf.to_container(cfg, resolve=True)
        torch.manual_seed(0)
        model = instantiate(config["model"])
        path = tmp_path / f"{level}.pt"
        torch.save({"model": model.state_dict(), "config": config, "epoch": 1}, path)
        return str(path)

    return write


def sample(capsys, *args: str) -> tuple[int, str, str]:
    code = sample_script.main([*args])
    out, err = capsys.readouterr()
    return code, out, err


def test_same_seed_same_text(checkpoint, capsys):
    path = checkpoint()
    code, first, _ = sample(capsys, path, "--prompt", "It is", "--max-new-tokens", "60", "--seed", "3")
    assert code == 0
    assert first.startswith("It is") and len(first) == len("It is") + 60 + 1  # the prompt, 60 tokens, print's "\n"
    assert set(first) <= set(TEXT)  # decoded with the checkpoint's vocabulary
    assert sample(capsys, path, "--prompt", "It is", "--max-new-tokens", "60", "--seed", "3")[1] == first
    assert sample(capsys, path, "--prompt", "It is", "--max-new-tokens", "60", "--seed", "4")[1] != first


def test_greedy_ignores_the_seed_and_samples_differ(checkpoint, capsys):
    path = checkpoint()
    greedy = [sample(capsys, path, "--temperature", "0", "--seed", seed, "--max-new-tokens", "20")[1] for seed in "12"]
    assert greedy[0] == greedy[1] and greedy[0].startswith("\n")  # the default prompt: a newline
    code, out, _ = sample(capsys, path, "--num-samples", "2", "--max-new-tokens", "30", "--top-k", "3")
    first, second = out.split("\n---------------\n")
    assert code == 0 and first != second and first.startswith("\n") and second.startswith("\n")


def test_a_model_padded_past_the_vocabulary_samples_the_vocabulary_alone(checkpoint, capsys):
    """As nanoGPT's GPT-2 (50304 ids for 50257 tokens): an untrained model draws the padding ids as often as any."""
    code, out, err = sample(capsys, checkpoint("char", "model.vocab_size=512"), "--max-new-tokens", "200")
    assert code == 0, err
    assert set(out) <= set(TEXT) and len(out) > 200


def test_byte_level_checkpoint(checkpoint, capsys):
    code, out, _ = sample(capsys, checkpoint("byte"), "--prompt", "naïve", "--max-new-tokens", "10")
    assert code == 0 and out.startswith("naïve")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prompt", "It is £5"],
            "--prompt='It is £5': character '£' at position 6 is not in the vocabulary of 25 characters "
            "(and 1 other character)",
        ),
        (["--temperature", "-1"], "--temperature=-1.0: must be >= 0 (0: greedy)"),
        (["--top-k", "-2"], "--top-k=-2: must be >= 0 (0: no limit)"),
        (["--max-new-tokens", "-1"], "--max-new-tokens=-1: must be at least 0"),
        (["--device", "gpu"], "device=gpu: not a device (use auto, cpu, cuda or cuda:N)"),
    ],
)
def test_bad_arguments_are_one_line(checkpoint, capsys, args, message):
    code, out, err = sample(capsys, checkpoint(), *args)
    assert code == BAD_INPUT_EXIT_CODE and out == ""
    assert err == f"sample.py: {message}\n"


def test_not_a_language_model_checkpoint(tmp_path, capsys):
    classifier = tmp_path / "mlp.pt"
    torch.save({"model": {}, "config": {"model": {"_target_": "x"}, "data": {"num_classes": 10}}}, classifier)
    assert sample(capsys, str(classifier))[2] == (
        f"sample.py: {classifier}: not a language-model checkpoint "
        "(its data config has no vocab or tokenizer; train with data=text, data=tokens or data=hf_lm)\n"
    )
    assert sample(capsys, str(tmp_path / "none.pt"))[2] == f"sample.py: {tmp_path / 'none.pt'}: no such file\n"
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    code, _, err = sample(capsys, str(garbage))
    assert code == BAD_INPUT_EXIT_CODE and err.startswith(f"sample.py: {garbage}: cannot be read as a checkpoint: ")


@pytest.mark.slow
def test_command_line(checkpoint):
    """The real command, twice: the same text, and the prompt error as one line with exit code 2."""
    path = checkpoint()
    command = [sys.executable, str(SCRIPT), path, "--prompt", "a single", "--max-new-tokens", "40", "--seed", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see conftest.one_thread
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=120, env=env) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("a single")
    bad = subprocess.run([*command[:3], "--prompt", "Zed"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == BAD_INPUT_EXIT_CODE and bad.stdout == ""
    assert (
        bad.stderr
        == "sample.py: --prompt='Zed': character 'Z' at position 0 is not in the vocabulary of 25 characters\n"
    )
