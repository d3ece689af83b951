"""Random numbers drawn on the state every rank holds alike (an optimizer's step, a callback's gradient hook) are the
ones one process draws: a noisy optimizer and a gradient-noise callback train the same weights under single, ddp
with accumulation over an uneven last batch, and fsdp, and a gradient norm logged by a callback is the same."""

import csv
from pathlib import Path

import pytest
import torch

from conftest import max_param_diff
from hydraloop.seeding import AFTER_THE_STEP, CHOOSING_THE_PASSES, StepSeeder

TOLERANCE = 1e-5  # as for DDP and FSDP's weights: per-rank mean gradients against one mean

# 1437 training images in batches of 48: 29 full steps and one of 45 rows (23 and 22 per rank; micro-batches of 8
# under ddp and accumulation 3, the last ones of 7 and 6).
NOISY = (
    "data.batch_size=48",
    "data.drop_last=false",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=5",
    "logger=csv",
    "callbacks=[grad_norm]",
    "optimizer._target_=tests.randomness.NoisyAdamW",
    "+optimizer.sigma=0.01",
    "+callbacks.noise._target_=tests.randomness.GradientNoise",
    "+callbacks.noise.sigma=0.01",
)


def grad_norms(run_dir: Path) -> list[float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return [float(row["train/grad_norm"]) for row in rows if row.get("train/grad_norm")]


@pytest.mark.slow
def test_noise_drawn_by_an_optimizer_and_a_gradient_hook_trains_the_same_under_every_strategy(run_train):
    single = run_train(*NOISY)
    assert single.returncode == 0, single.output
    expected = single.checkpoint()
    assert single.metrics["global_step"] == 30
    assert expected["callbacks"]["noise"]["calls"] == {"before_optimizer_step/": 30, "after_clipping/": 30}
    norms = grad_norms(single.run_dir)
    assert len(norms) == 6  # steps 5, 10, ..., 30
    runs = {
        "ddp, accumulating": run_train(*NOISY, "parallel=ddp", "trainer.grad_accum_steps=3"),
        "fsdp": run_train(*NOISY, "parallel=fsdp"),
    }
    for name, run in runs.items():
        assert run.returncode == 0, name + run.output
        assert max_param_diff(run.checkpoint()["model"], expected["model"]) < TOLERANCE, name
        assert grad_norms(run.run_dir) == pytest.approx(norms, rel=1e-5), name
    # The noise is no small part of the update: without it the weights end elsewhere.
    quiet = run_train(*(override.replace("sigma=0.01", "sigma=0.0") for override in NOISY))
    assert quiet.returncode == 0, quiet.output
    assert max_param_diff(quiet.checkpoint()["model"], expected["model"]) > 1e-2


def test_the_gradient_hooks_see_the_gradients_unscaled_under_fp16(train_in_process):
    common = ("trainer.max_steps=5", "trainer.log_every_n_steps=5", "logger=csv", "callbacks=[grad_norm]")
    _, full_precision = train_in_process(*common)
    _, half_precision = train_in_process(*common, "trainer.precision=fp16")
    # The loss scale (2**16 to start with) divided out: the norm of the same gradients, computed in half precision.
    assert grad_norms(half_precision) == pytest.approx(grad_norms(full_precision), rel=1e-2)


def test_the_step_draws_per_rank_for_the_forward_and_alike_for_the_replicated_state():
    def draws(seeder: StepSeeder, step: int, part: int | None = None, pass_index: int = 0) -> torch.Tensor:
        if part is None:
            seeder(step, pass_index)
        else:
            seeder.replicated(step, part)
        return torch.rand(4)

    rank0, rank1 = StepSeeder(7, 0, []), StepSeeder(7, 1, [])
    assert torch.equal(draws(rank0, 3, part=0), draws(rank1, 3, part=0))  # the state every rank holds
    assert torch.equal(draws(rank0, 3, part=AFTER_THE_STEP), draws(rank1, 3, part=AFTER_THE_STEP))
    assert not torch.equal(draws(rank0, 3), draws(rank1, 3))  # each rank's rows: masks of its own
    streams = [
        draws(rank0, 3),
        draws(rank0, 3, pass_index=1),
        draws(rank0, 4),
        draws(rank0, 3, part=0),
        draws(rank0, 3, part=1),
        draws(rank0, 4, part=0),
        draws(rank0, 3, part=AFTER_THE_STEP),
        draws(rank0, 3, part=CHOOSING_THE_PASSES),
        draws(StepSeeder(8, 0, []), 3, part=0),
    ]
    assert len({tuple(stream.tolist()) for stream in streams}) == len(streams)  # every part of every step its own


def _grad_norm_columns(run_dir: Path) -> dict[str, list[float]]:
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    columns = [name for name in rows[0] if name.startswith("train/grad_norm")]
    return {name: [float(row[name]) for row in rows if row.get(name)] for name in columns}


def test_two_grad_norm_callbacks_log_both_norms(train_in_process):
    common = ("trainer.max_steps=2", "trainer.log_every_n_steps=1", "logger=csv", "callbacks=[grad_norm]")
    _, euclidean = train_in_process(*common)
    _, both = train_in_process(
        *common,
        "+callbacks.grad_norm_inf._target_=hydraloop.callbacks.grad_norm.GradNorm",
        "+callbacks.grad_norm_inf.norm_type=inf",
    )
    l2 = _grad_norm_columns(euclidean)["train/grad_norm"]
    logged = _grad_norm_columns(both)
    # Each callback's key names its metric: the L2 norm written first was overwritten by the inf-norm.
    assert any(values == pytest.approx(l2) for values in logged.values()), (l2, logged)
    assert len(logged) == 2, logged
