"""Bad input ends in one clear line naming the key and the value, a non-zero exit, no traceback, and nothing
half-written in the run directory."""

import shutil

import pytest
import torch
from hydra.core.config_store import ConfigStore

from conftest import REPO, bad_input_line
from hydraloop.checks.command_line import check_group_options
from hydraloop.errors import ConfigError

HALF_WRITTEN = ("checkpoints", "metrics.json", "tensorboard")


def assert_rejected(run, *expected: str) -> str:
    """Our own bad-input exit: returns the one error line, after checking it names everything in `expected`."""
    error = bad_input_line(run)
    for text in expected:
        assert text in error, error
    for name in HALF_WRITTEN:
        assert not (run.run_dir / name).exists(), f"{name} written by a rejected run"
    return error


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.batch_size=0", "data.batch_size=0: must be positive"),
        ("data.batch_size=-4", "data.batch_size=-4: must be positive"),
        ("optimizer.lr=0", "optimizer.lr=0: must be a positive finite number"),
        ("optimizer.lr=-0.1", "optimizer.lr=-0.1: must be a positive finite number"),
        # The schema types `optimizer` as Any, so only check_config stands between a string and torch.optim.
        ("optimizer.lr=abc", "optimizer.lr=abc: must be a positive finite number"),
        ("trainer.max_epochs=0", "trainer.max_epochs=0: must be positive"),
        ("device=banana", "device=banana: not a device"),
        ("optimized_metric=val/f1", "optimized_metric=val/f1: the task reports val/loss, val/acc, val/acc_top5"),
        ("optimized_metric_mode=up", "optimized_metric_mode=up: must be max or min"),
        ("trainer.precision=fp8", "trainer.precision=fp8: must be one of 32, bf16, fp16"),
        ("trainer.grad_accum_steps=5", "trainer.grad_accum_steps=5: data.batch_size=64 does not split"),
        ("trainer.limit_train_batches=0", "trainer.limit_train_batches=0: must be positive"),
        ("trainer.keep_last_k=0", "trainer.keep_last_k=0: must be at least 1"),
        ("trainer.cpu_threads=0", "trainer.cpu_threads=0: must be positive, or null"),
        ("data.prefetch_factor=0", "data.prefetch_factor=0: must be positive, or null"),
        # Found where the data set is built (in the launcher too): a split or a batch that leaves an epoch stepless.
        ("data.dataset.val_fraction=1.5", "data.dataset.val_fraction=1.5: must be between 0 and 1 (exclusive)"),
        ("data=synthetic data.dataset.num_val=0", "data.dataset.num_val=0: must be positive"),
        (
            "data.batch_size=2048",
            "data.batch_size=2048: more than the training set's 1438 samples; with data.drop_last=true an epoch "
            "would have no step (lower data.batch_size, or set data.drop_last=false)",
        ),
        # A key its _target_ does not take (keys of built nodes are free-form), and a _target_ that is not there.
        ("+model.widht=3", "model.widht=3: hydraloop.models.mlp.MLP takes no argument 'widht' (it takes input_shape,"),
        (
            "+optimizer.weight_deacy=0.1",
            "torch.optim.AdamW takes no argument 'weight_deacy'; did you mean weight_decay?",
        ),
        ("model._target_=hydraloop.models.mlpx.MLP", "cannot import it: No module named 'hydraloop.models.mlpx'"),
    ],
)
def test_out_of_range_value(run_refused, override, message):
    assert_rejected(run_refused(*override.split()), message)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optimizer.betas=[0.9,1.5]"],
            "optimizer.betas=[0.9, 1.5]: torch.optim.AdamW says: Invalid beta parameter at index 1: 1.5",
        ),
        (  # torch's message names two keys
            ["optimizer=sgd", "optimizer.nesterov=true", "optimizer.momentum=0"],
            "optimizer.momentum=0, optimizer.nesterov=True: torch.optim.SGD says: Nesterov momentum requires a "
            "momentum and zero dampening",
        ),
        (["scheduler=step", "scheduler.step_epochs=0"], "scheduler.step_epochs=0: must be positive"),
        (["model.dropout=1.5"], "model.dropout=1.5: must be in [0, 1)"),
        (["model.hidden_sizes=[64,-5]"], "model.hidden_sizes=[64, -5]: must be positive integers"),
        # An even kernel would change each layer's length, and the head's width with it, in every rank's first step.
        (["model=cnn", "model.kernel_size=4"], "model.kernel_size=4: must be a positive odd number"),
        (["scheduler=cosine", "scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio=2: must be between 0 and 1"),
    ],
)
def test_a_value_the_model_optimizer_or_scheduler_refuses_ends_the_run_before_any_rank(run_refused, overrides, message):
    """arguments.check_model and check_optimization build them in the launcher (the model on the meta device, the
    optimizer and the scheduler on one CPU parameter): the ranks would otherwise each fail with a traceback from
    inside Hydra's instantiate (or, for a schedule or an even kernel, at their first step)."""
    run = run_refused("parallel=ddp", *overrides)
    assert assert_rejected(run, message).endswith(message)
    assert "[rank " not in run.output  # no rank started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(run_refused):
    assert_rejected(run_refused("device=cuda"), "device=cuda: CUDA is not available")


def test_global_batch_not_divisible_by_ddp_world_size(run_refused):
    run = run_refused("parallel=ddp", "parallel.nproc_per_node=2", "data.batch_size=63")
    assert_rejected(run, "data.batch_size=63", "world size 2")
    # Rejected in the launcher: no rank ever logged (workers would log training or "[rank 1]" lines).
    assert "hydraloop.trainer" not in run.output
    assert "[rank " not in run.output
    assert not run.run_dir.exists()  # refused before anything was written: not even train.log


def test_nccl_with_more_processes_than_gpus(run_refused):
    gpus = torch.cuda.device_count()
    nproc = max(2, gpus + 1)
    run = run_refused("parallel=ddp", "parallel.backend=nccl", f"parallel.nproc_per_node={nproc}")
    if gpus:
        assert_rejected(run, f"parallel.nproc_per_node={nproc}", f"only {gpus} GPU(s) visible")
    else:  # no GPU at all: the backend is what does not fit, whatever the number of processes
        assert_rejected(run, "parallel.backend=nccl", "this run computes on the CPU (no GPU is visible)")


def test_ddp_with_zero_processes(run_refused):
    run = run_refused("parallel=ddp", "parallel.nproc_per_node=0", "trainer.max_epochs=1")
    assert_rejected(run, "parallel.nproc_per_node=0", "must be at least 1")


# --- ckpt_path -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(run_train):
    """last.pt of a real 1-epoch run with the default model (mlp, hidden_sizes [128, 128]) and optimizer (adamw)."""
    run = run_train("trainer.max_epochs=1", "logger=none")
    assert run.returncode == 0, run.output
    return run.run_dir / "checkpoints" / "last.pt"


def test_checkpoint_that_does_not_exist(run_refused, tmp_path):
    path = tmp_path / "nowhere" / "last.pt"
    assert_rejected(run_refused(f"ckpt_path={path}"), f"ckpt_path={path}: no such file")


def test_checkpoint_that_is_not_a_checkpoint(run_refused, tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(bytes(range(256)) * 16)
    assert_rejected(run_refused(f"ckpt_path={path}"), f"ckpt_path={path}: not a readable checkpoint")


def test_checkpoint_missing_keys(run_refused, tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"model": {}, "epoch": 1}, path)
    assert_rejected(
        run_refused(f"ckpt_path={path}"),
        f"ckpt_path={path}: not a hydraloop checkpoint (missing optimizer, scheduler, global_step, rng)",
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.hidden_sizes=[32]",
            "does not fit model hydraloop.models.mlp.MLP (net.1.bias has shape [128], model needs [32]",
        ),
        ("model=cnn", "does not fit model hydraloop.models.cnn.CNN (missing features.0.bias"),
        ("optimizer=sgd", "holds torch.optim.AdamW state"),
    ],
)
def test_checkpoint_that_does_not_fit(run_refused, checkpoint, override, message):
    run = run_refused(f"ckpt_path={checkpoint}", override, "trainer.max_epochs=2")
    assert_rejected(run, f"ckpt_path={checkpoint}", message)


def test_run_directory_checkpoint_that_does_not_fit(run_refused, checkpoint, tmp_path):
    """resume=true continues from the run directory's own last.pt; a config it does not fit says so, and how to
    start over, without touching that checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    own = run_dir / "checkpoints" / "last.pt"
    shutil.copy(checkpoint, own)
    error = bad_input_line(run_refused("model.hidden_sizes=[32]", run_dir=run_dir))
    assert f"resume=true: {own}: does not fit model hydraloop.models.mlp.MLP" in error
    assert error.endswith("(resume=false starts the run directory over)")
    assert own.read_bytes() == checkpoint.read_bytes()


# --- Hydra composition ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=transformer"],
            "model=transformer: 'transformer' is not an option of model (cnn, gan, gpt, hf, mlp, timm, torchvision)",
        ),
        (["logger=[csv,foo]"], "logger=[csv,foo]: 'foo' is not an option of logger (csv, mlflow, none, tensorboard"),
        (["+experiment=text_gtp"], "+experiment=text_gtp: 'text_gtp' is not an option of experiment (diabetes_mlp,"),
        (
            ["-m", "optimizer=adamw,sgdd"],
            "optimizer=adamw,sgdd: 'sgdd' is not an option of optimizer (adamw, gan, sgd)",
        ),
    ],
)
def test_unknown_group_option(run_refused, tmp_path, overrides, message):
    run = run_refused(*overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}", run_dir=tmp_path / "never")
    assert message in bad_input_line(run)
    assert not run.run_dir.exists() and not (tmp_path / "sweep").exists()


def test_a_group_option_registered_in_python_is_an_option():
    ConfigStore.instance().store(group="model", name="registered_in_python", node={"_target_": "my.Model"})
    check_group_options(["-m", "model=mlp,registered_in_python"], REPO / "conf")
    with pytest.raises(ConfigError, match="'registered_in_pyton' is not an option of model"):
        check_group_options(["model=registered_in_pyton"], REPO / "conf")


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_epochs=abc", "trainer.max_epochs=abc: must be an integer"),
        ("data.batch_size=1.5", "data.batch_size=1.5: must be an integer"),
        ("seed=xyz", "seed=xyz: must be an integer"),
        (
            "trainer.max_epoch=3",
            "trainer.max_epoch=3: trainer has no key 'max_epoch'; did you mean trainer.max_epochs?",
        ),
    ],
)
def test_what_hydras_composition_refuses_is_one_line_before_anything_is_made(run_refused, tmp_path, override, message):
    """Hydra's own errors for these span several lines and exit 1 (hydraloop.checks.command_line composes first)."""
    run = run_refused(override, run_dir=tmp_path / "never")
    assert bad_input_line(run).endswith(message)
    assert not run.run_dir.exists()
