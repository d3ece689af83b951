"""Shared helpers: run the real entrypoint in a subprocess, read what it wrote."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from core_share import share_the_cores_between_test_workers
from hydraloop.config import register_configs
from hydraloop.errors import BAD_INPUT_EXIT_CODE
from hydraloop.preemption import STOP_SIGNALS, stop_taken

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "src" / "train.py"

share_the_cores_between_test_workers()


def compose_train(*overrides: str) -> DictConfig:
    """conf/train.yaml with `overrides`, composed as the entrypoint composes it, outside a Hydra run (whose output
    directory and log file it stands in for, so that the whole config resolves)."""
    register_configs()  # the schemas conf/train.yaml builds on
    GlobalHydra.instance().clear()  # another test (or a crashed one) may have left Hydra initialised
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=[*overrides, "output_dir=/unused", "log_file=/unused"])


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr together
    run_dir: Path

    @property
    def metrics(self) -> dict:
        return json.loads((self.run_dir / "metrics.json").read_text())

    def checkpoint(self, name: str = "last.pt") -> dict:
        return read_checkpoint(self.run_dir / "checkpoints" / name)

    @property
    def log(self) -> str:
        return (self.run_dir / "train.log").read_text()


@pytest.fixture(autouse=True)
def signal_handlers_as_they_were():
    """A run trained in the test's own process that stopped leaves its stop signals and SIGINT dropped for the
    process's lifetime (hydraloop.preemption.ignore_further_stops): the next test, and Ctrl-C, get them back."""
    handled = (signal.SIGINT, *STOP_SIGNALS)
    before = {sig: signal.getsignal(sig) for sig in handled}
    yield
    stop_taken()  # one a test raised and caught itself
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One MNIST-1D cache per test session, away from the user's ~/.cache."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def train_env(data_cache) -> dict[str, str]:
    env = dict(os.environ)
    # Set by an in-process W&B run (test_loggers.py): a job would log through this process's W&B service, which
    # writes on after the job has exited.
    env.pop("WANDB_SERVICE", None)
    env["XDG_CACHE_HOME"] = str(data_cache)
    env["HYDRA_FULL_ERROR"] = "0"
    # Fault-injection models live in tests/; workers import them by module path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="session")
def image_folder(data_cache, train_env) -> Path:
    """scripts/make_image_folder.py's digits as PNGs (1437 train, 360 val, 10 classes, 32x32), once per session,
    where experiment=images_resnet looks for them (under the session's XDG_CACHE_HOME)."""
    root = data_cache / "hydraloop" / "digits_images"
    script = REPO / "scripts" / "make_image_folder.py"
    subprocess.run([sys.executable, str(script), str(root)], env=train_env, check=True, capture_output=True)
    return root


@pytest.fixture(scope="session")
def forked_train(train_env):
    """forked_train(args, cwd, timeout) -> (returncode, output): `python src/train.py ARGS` forked from
    tests/fork_server.py (torch imported once per test session, not once per command); raises
    subprocess.TimeoutExpired as subprocess.run does."""
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "fork_server.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=train_env,
        text=True,
    )

    def run(args: list[str], cwd: Path, timeout: float | None) -> tuple[int, str]:
        output = Path(tempfile.mkstemp(prefix="train-", suffix=".txt")[1])
        request = {"args": args, "cwd": str(cwd), "output": str(output), "timeout": timeout}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        assert reply, "tests/fork_server.py ended"
        text = output.read_text()
        output.unlink()
        reply = json.loads(reply)
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired([str(TRAIN), *args], timeout, output=text)
        return reply["returncode"], text

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.fixture(scope="session")
def run_train(train_env, tmp_path_factory, forked_train):
    """run_train(*overrides, run_dir=None, timeout=180) -> Run, for `python src/train.py OVERRIDES` (forked as
    conftest's forked_train runs it).

    `wrapper`: a command the training command is passed to (e.g. `unshare ...`); `preexec_fn`: as subprocess's; either
    runs it as a plain subprocess.
    """

    def run(
        *overrides: str,
        run_dir: Path | None = None,
        timeout: float = 180,
        cwd: Path | None = None,
        wrapper: tuple[str, ...] = (),
        preexec_fn=None,
    ) -> Run:
        run_dir = run_dir or tmp_path_factory.mktemp("run")
        flags = [arg for arg in overrides if arg.startswith("-")]  # Hydra's argparse wants -m before overrides
        overrides = [arg for arg in overrides if not arg.startswith("-")]
        args = [*flags, f"hydra.run.dir={run_dir}", *overrides]
        if not wrapper and preexec_fn is None:
            returncode, output = forked_train(args, cwd or REPO, timeout)
            return Run(returncode, output, Path(run_dir))
        proc = subprocess.run(
            [*wrapper, sys.executable, str(TRAIN), *args],
            cwd=cwd or REPO,
            env=train_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=preexec_fn,
        )
        return Run(proc.returncode, proc.stdout + proc.stderr, Path(run_dir))

    return run


@pytest.fixture(scope="session")
def run_refused(run_train):
    """run_refused(*overrides, run_dir=None) -> Run: run_train, named for a command expected to be refused before any
    rank starts."""
    return run_train


def torchrun_command(
    *overrides: str, launcher_args: tuple[str, ...] = ("--standalone", "--nproc_per_node=2"), parallel: str = "ddp"
) -> list[str]:
    """`torchrun LAUNCHER_ARGS src/train.py parallel=PARALLEL OVERRIDES`: every process is a rank."""
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(TRAIN), f"parallel={parallel}"]
    return [*command, *overrides]


def torchrun_train(*overrides: str, env: dict, cwd: Path = REPO, parallel: str = "ddp") -> subprocess.CompletedProcess:
    command = torchrun_command(*overrides, parallel=parallel)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    """Until `path` exists; fails if `process` ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def bad_input_line(run: Run) -> str:
    """The one error line of a run that ended as bad input: exit code 2, no traceback."""
    assert run.returncode == BAD_INPUT_EXIT_CODE, run.output
    assert "Traceback" not in run.output, run.output
    errors = [line for line in run.output.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, run.output
    return errors[0]


def read_checkpoint(path: Path) -> dict:
    """A checkpoint, whole: a file as plain torch.load(weights_only=True) reads it; a sharded one (a directory:
    parallel=fsdp's) in the same format (hydraloop.sharded_checkpoint)."""
    if Path(path).is_dir():
        from hydraloop.checkpoint import load_checkpoint

        return load_checkpoint(path)
    return torch.load(path, weights_only=True)


def max_param_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture
def train_in_process(tmp_path, monkeypatch, data_cache):
    """train_in_process(*overrides, run_dir=None) -> (metrics, run_dir): src/train.py's task function, called
    directly; into `run_dir` (again), or a new one.

    For single-process behaviour where a subprocess's start-up would dominate.
    """
    from hydra import compose, initialize_config_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
    monkeypatch.syspath_prepend(str(REPO / "src"))
    import train  # src/train.py; importing registers the schemas

    def run(*overrides: str, run_dir: Path | None = None) -> tuple[dict, Path]:
        run_dir = run_dir or Path(tempfile.mkdtemp(dir=tmp_path))
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            # Outside a Hydra run there is no hydra:runtime.output_dir to interpolate: name the paths.
            cfg = compose("train", overrides=[*overrides, f"output_dir={run_dir}", f"log_file={run_dir}/train.log"])
        train.main.__wrapped__(cfg)
        return json.loads((run_dir / "metrics.json").read_text()), run_dir

    return run


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests of models so small they gain nothing from a second: on a busy machine each op
    would wait for it to be scheduled (100x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow database for the session's logger=mlflow runs: making one runs MLflow's table migrations (~9 s)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri)
    return uri


def write_random_tokens(folder: Path, train_tokens: int, vocab_size: int = 64) -> Path:
    """A data=tokens folder of uniformly random ids (and 4096 val tokens), written in slices: memory stays small."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", train_tokens), ("val", 4096)):
        ids = np.empty(count, np.uint16)
        for start in range(0, count, 1 << 22):
            ids[start : start + (1 << 22)] = rng.integers(0, vocab_size, min(1 << 22, count - start))
        ids.tofile(folder / f"{split}.bin")
    meta = {"dtype": "uint16", "vocab_size": vocab_size, "tokenizer": {"kind": "random"}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture(scope="session")
def token_folder(tmp_path_factory) -> Path:
    """A small data=tokens folder, with GPT-2's vocabulary size (the gpt2_124m recipe reads it)."""
    return write_random_tokens(tmp_path_factory.mktemp("tokens") / "random", 20_000, vocab_size=50257)


def prepare_tokens(source: Path, out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python scripts/prepare_text.py SOURCE OUT ARGS`: a data=tokens folder made from text."""
    command = [sys.executable, str(REPO / "scripts" / "prepare_text.py"), str(source), str(out), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="session")
def char_tokens(tmp_path_factory, train_env) -> Path:
    """The bundled corpus, prepared at char level."""
    from hydraloop.data.text import corpus_path

    out = tmp_path_factory.mktemp("tokens") / "char"
    done = prepare_tokens(corpus_path(None), out, env=train_env)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def plays(tmp_path_factory) -> tuple[Path, Path]:
    """The data=hf tests' csv of labelled lines of the plays, and a tokenizer trained on them (tests/plays.py)."""
    from plays import write_plays

    return write_plays(tmp_path_factory.mktemp("plays"))
