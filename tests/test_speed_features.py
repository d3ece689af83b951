"""The fast paths (issue: speed) change speed, not results: each is compared with the plain run."""

import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, max_param_diff, read_checkpoint

ROUND_OFF = 1e-5


def weights(run_dir, name="last.pt"):
    return read_checkpoint(run_dir / "checkpoints" / name)["model"]


_REFERENCE: dict = {}


def reference(train_in_process):
    """The plain run all fast paths are compared with: 2 epochs of the default recipe, single process."""
    cache = _REFERENCE
    if "run" not in cache:
        cache["run"] = train_in_process("trainer.max_epochs=2", "logger=none")
    return cache["run"]


def test_gradient_accumulation_matches_one_big_batch(train_in_process):
    metrics, run_dir = reference(train_in_process)
    accumulated, accumulated_dir = train_in_process("trainer.max_epochs=2", "logger=none", "trainer.grad_accum_steps=4")
    assert accumulated["global_step"] == metrics["global_step"]  # data.batch_size is still the batch per step
    assert max_param_diff(weights(accumulated_dir), weights(run_dir)) < ROUND_OFF
    assert accumulated["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_under_ddp_matches_single(run_train, train_in_process):
    _, run_dir = reference(train_in_process)
    ddp = run_train("parallel=ddp", "trainer.max_epochs=2", "logger=none", "trainer.grad_accum_steps=4")
    assert ddp.returncode == 0, ddp.output
    assert max_param_diff(ddp.checkpoint()["model"], weights(run_dir)) < ROUND_OFF


def test_data_on_device_matches_the_dataloader(train_in_process):
    metrics, run_dir = reference(train_in_process)
    on_device, on_device_dir = train_in_process("trainer.max_epochs=2", "logger=none", "data.on_device=true")
    assert max_param_diff(weights(on_device_dir), weights(run_dir)) == 0.0  # same samples, same order
    assert on_device["val/acc"] == metrics["val/acc"]


@pytest.mark.slow
def test_data_on_device_under_ddp_matches_single(run_train, train_in_process):
    _, run_dir = reference(train_in_process)
    ddp = run_train("parallel=ddp", "trainer.max_epochs=2", "logger=none", "data.on_device=true")
    assert ddp.returncode == 0, ddp.output
    assert max_param_diff(ddp.checkpoint()["model"], weights(run_dir)) < ROUND_OFF


@pytest.mark.slow
def test_ddp_knobs_keep_results(run_train, train_in_process):
    _, run_dir = reference(train_in_process)
    ddp = run_train(
        "parallel=ddp",
        "trainer.max_epochs=2",
        "logger=none",
        "parallel.bucket_cap_mb=0.01",
        "parallel.gradient_as_bucket_view=false",
        "parallel.static_graph=true",
    )
    assert ddp.returncode == 0, ddp.output
    assert max_param_diff(ddp.checkpoint()["model"], weights(run_dir)) < ROUND_OFF


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(train_in_process, precision):
    metrics, run_dir = train_in_process("trainer.max_epochs=4", "logger=none", f"trainer.precision={precision}")
    assert metrics["val/acc"] > 0.9  # float32 reaches ~0.94 after 4 epochs
    checkpoint = read_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert all(tensor.dtype == torch.float32 for tensor in checkpoint["model"].values())  # master weights
    if precision == "fp16":
        assert checkpoint["grad_scaler"]["scale"] > 0  # the loss scale, restored on resume
    else:
        assert checkpoint["grad_scaler"] == {}  # bf16 needs no loss scaling


def test_fp16_resume_matches_uninterrupted(train_in_process):
    _, first = train_in_process("trainer.max_epochs=1", "logger=none", "trainer.precision=fp16")
    _, resumed = train_in_process(
        "trainer.max_epochs=2", "logger=none", "trainer.precision=fp16", f"ckpt_path={first}/checkpoints/last.pt"
    )
    _, uninterrupted = train_in_process("trainer.max_epochs=2", "logger=none", "trainer.precision=fp16")
    assert max_param_diff(weights(resumed), weights(uninterrupted)) == 0.0


def test_cpu_threads_sets_each_ranks_pool_and_keeps_results(train_in_process):
    metrics, run_dir = reference(train_in_process)
    default = torch.get_num_threads()
    threads = 1 if default > 1 else 2  # a change either way
    try:
        pooled, pooled_dir = train_in_process("trainer.max_epochs=2", "logger=none", f"trainer.cpu_threads={threads}")
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(default)
    assert max_param_diff(weights(pooled_dir), weights(run_dir)) < ROUND_OFF
    assert pooled["val/acc"] == pytest.approx(metrics["val/acc"], abs=1e-3)


def test_channels_last_conv_net_matches(train_in_process):
    _, plain_dir = train_in_process("model=cnn", "trainer.max_epochs=1", "logger=none")
    _, channels_last_dir = train_in_process(
        "model=cnn", "trainer.max_epochs=1", "logger=none", "trainer.channels_last=true"
    )
    assert max_param_diff(weights(channels_last_dir), weights(plain_dir)) < 1e-4  # other kernels, same maths


@pytest.mark.slow
def test_compile_under_ddp_matches_single_with_plain_checkpoint_keys(run_train, train_in_process):
    _, run_dir = reference(train_in_process)
    compiled = run_train("parallel=ddp", "trainer.max_epochs=2", "logger=none", "trainer.compile=true", timeout=400)
    assert compiled.returncode == 0, compiled.output
    state = compiled.checkpoint()["model"]
    assert state.keys() == weights(run_dir).keys()  # no `_orig_mod.` or `module.` prefixes
    assert max_param_diff(state, weights(run_dir)) < ROUND_OFF


def test_no_host_sync_in_the_steady_state_step(train_in_process, monkeypatch):
    """Reading a tensor back to Python (.item(), .tolist(), float(), bool()) waits for the device. The loop does
    it on logging steps and at epoch ends only: the count must not grow with the number of steps."""
    calls = []
    # The project's own code only, by where it lies: not by a name in the path, which a clone named hydraloop (git's
    # default) with .venv inside shares with torch's own files.
    own_code = str((REPO / "src").resolve())
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(own_code):
                calls.append(caller)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    counts = []
    for steps in (4, 16):
        calls.clear()
        train_in_process(
            "trainer.max_epochs=2",
            "logger=none",
            f"trainer.limit_train_batches={steps}",
            "trainer.log_every_n_steps=1000",
        )
        counts.append(len(calls))
    assert counts[0] == counts[1] and counts[0] <= 8  # per epoch: the epoch loss and the validation totals


def test_efficiency_metrics_in_tensorboard(train_in_process):
    _, run_dir = train_in_process("trainer.max_epochs=1", "trainer.log_every_n_steps=5")
    accumulator = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    values = {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    assert len(values["perf/samples_per_sec"]) == 22 // 5
    assert all(0.0 <= frac <= 1.0 for frac in values["perf/data_wait_frac"])
    assert all(ms > 0 for ms in values["perf/step_time_ms"])
    assert "perf/max_memory_gb" not in values  # CUDA only


def test_start_up_pauses_the_collector_only_during_the_imports():
    """src/train.py pauses the cyclic collector for its imports (start-up time): afterwards it must be running again,
    with what the imports made frozen out of later collections, and torch._dynamo (which every optimizer imports)
    already loaded."""
    probe = (
        "import gc, sys; sys.path.insert(0, 'src'); import train; "
        "print(gc.isenabled(), gc.get_freeze_count(), 'torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    enabled, frozen, dynamo_loaded = proc.stdout.split()
    assert enabled == "True" and dynamo_loaded == "True"
    assert int(frozen) > 100_000  # torch alone makes a few hundred thousand objects
