"""scripts/check_exact.py: one command that runs a training command under single, ddp, fsdp, accumulation over an
uneven last batch and a stop-then-resume, and compares each with single (hydraloop.exactness)."""

import math
import subprocess
import sys

import pytest
import torch

from conftest import REPO, bad_input_line
from hydraloop.data.samplers import GlobalBatchSampler
from hydraloop.exactness import PartDifference, compare, difference, table
from hydraloop.final_state import FinalState

CHECK = REPO / "scripts" / "check_exact.py"


def check_exact(train_env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], cwd=REPO, env=train_env, capture_output=True, text=True, timeout=900
    )


def rows(output: str) -> dict[str, str]:
    """The table's lines (after its header) by their row label (the text before two spaces)."""
    table = output[output.index("\nrow ") + 1 :].splitlines()[1:]
    return {line.split("  ")[0]: line for line in table if line.strip() and not line.startswith("the runs'")}


@pytest.mark.slow
def test_a_shipped_experiment_passes_every_row(train_env):
    """SimCLR: views drawn with keyed_random, a loss over the global batch (gathered; two passes under accumulation)."""
    check = check_exact(train_env, "experiment=digits_simclr")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Contrastive: a loss over the global batch: its rows are gathered over the ranks" in check.stdout
    lines = rows(check.stdout)
    # digits_simclr's batch of 256 splits into 2 ranks x 2 micro-batches; the epoch is 2 batches and one of 3 rows.
    assert list(lines) == [
        "single",
        "ddp, 2 ranks",
        "fsdp, 2 ranks",
        "ddp, 2 ranks, accumulation 2, last batch 3 rows",
        "fsdp stopped after step 2, resumed under single",
    ]
    assert "reference" in lines.pop("single")
    for line in lines.values():
        assert " pass" in line and "FAIL" not in line, check.stdout


@pytest.mark.slow
def test_a_model_whose_forward_depends_on_its_rank_fails_naming_the_parameter(train_env):
    check = check_exact(
        train_env, "experiment=digits_mlp", "model._target_=tests.faults.RankDependentMLP", "--rows", "ddp"
    )
    assert check.returncode == 1, check.stdout + check.stderr
    line = rows(check.stdout)["ddp, 2 ranks"]
    # The logits of rank 1 are 1.1 times rank 0's: every gradient differs, the first layer's weight first.
    assert "FAIL" in line and "parameters: net.1.weight" in line, check.stdout
    # No draw from a generator to name: the causes no run can see.
    assert (
        "ddp, 2 ranks: cause: no per-rank draw was seen" in check.stdout and "code that reads its rank" in check.stdout
    )


def test_the_check_refuses_a_command_hydra_cannot_compose(train_env):
    check = check_exact(train_env, "model=no_such_model")
    assert check.returncode == 2, check.stdout + check.stderr
    assert "no_such_model" in check.stderr and "Traceback" not in check.stderr


def state(parameters: dict, optimizer: dict | None = None, metrics: dict | None = None) -> FinalState:
    parts = {"parameters": parameters, "optimizer": optimizer or {}, "callbacks": {}, "metrics": metrics or {}}
    return FinalState(parts, global_step=1)


def test_a_difference_is_relative_to_the_largest_value_of_its_kind_and_names_the_first_entry_beyond_tolerance():
    reference = state(
        {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-8, 0.0]), "c": torch.tensor([4.0])},
        optimizer={"exp_avg[a]": torch.tensor([1e-3]), "exp_avg_sq[a]": torch.tensor([1e-8]), "lr": 1e-3},
        metrics={"val/loss": 2.0, "stopped_early": None},
    )
    other = state(
        {"a": torch.tensor([1.0, -2.0 + 2e-6]), "b": torch.tensor([3e-8, 0.0]), "c": torch.tensor([4.4])},
        optimizer={"exp_avg[a]": torch.tensor([1e-3]), "exp_avg_sq[a]": torch.tensor([1.1e-8]), "lr": 1e-3},
        metrics={"val/loss": 2.0, "stopped_early": None},
    )
    comparison = compare(reference, other, tolerance=1e-4)
    parameters = comparison.parts["parameters"]
    # Over the parameters' largest value, 4.4: a 2e-6, b (noise of a tensor near zero) 2e-8, c 0.4.
    assert parameters.largest == pytest.approx(0.4 / 4.4, rel=1e-6)
    assert parameters.first == "c"
    # Each optimizer state over its own kind's largest value: exp_avg_sq's 1.1e-8.
    optimizer = comparison.parts["optimizer"]
    assert optimizer.first == "exp_avg_sq[a]" and optimizer.first_value == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert comparison.parts["callbacks"] == PartDifference()  # neither run has any: shown as "-"
    assert comparison.parts["metrics"].largest == 0.0
    assert not comparison.passed and comparison.first == "parameters: c (9.1e-02)"


def test_an_entry_one_run_lacks_or_a_value_that_differs_is_an_infinite_difference():
    reference = state({"a": torch.zeros(2)}, metrics={"stopped_early": None, "val/acc": 0.5})
    other = state({"a": torch.zeros(2), "extra": torch.zeros(1)}, metrics={"stopped_early": {"epoch": 1}})
    comparison = compare(reference, other, tolerance=1e-4)
    assert comparison.parts["parameters"].first == "extra"
    assert comparison.parts["metrics"].first == "stopped_early" and comparison.parts["metrics"].largest == math.inf
    # A reference with more (here val/acc) serves a run without it where the run may lack it, and only there.
    lacking = state({"a": torch.zeros(2)}, metrics={"stopped_early": None})
    assert compare(reference, lacking, 1e-4, may_lack=("metrics/val/*",)).passed
    assert compare(reference, lacking, 1e-4, may_lack=("metrics/best/*",)).parts["metrics"].first == "val/acc"
    assert difference(torch.zeros(2), torch.zeros(3)) == math.inf
    assert difference(torch.tensor([math.nan]), torch.tensor([math.nan])) == 0.0
    assert difference(torch.tensor([3], dtype=torch.int64), torch.tensor([4], dtype=torch.int64)) == 0.25
    shown = table([("single", None), ("ddp", comparison)]).splitlines()
    assert shown[0].split() == [
        "row",
        "parameters",
        "optimizer",
        "callbacks",
        "metrics",
        "result",
        "first",
        "beyond",
        "tolerance",
    ]
    assert shown[2].split()[:6] == ["ddp", "inf", "-", "-", "inf", "FAIL"]


def test_limit_train_samples_ends_each_epoch_with_a_batch_of_what_is_left():
    """trainer.limit_train_samples=29 with batches of 12: batches of 12, 12 and 5 rows, the same 29 samples of the
    epoch's order under 1 and 2 ranks (5 rows over 2 ranks: 3 and 2)."""
    single = GlobalBatchSampler(100, 12, 0, 1, seed=0, drop_last=False, limit_samples=29)
    assert [len(batch) for batch in single] == [12, 12, 5] and single.steps_per_epoch == 3
    ranks = [GlobalBatchSampler(100, 12, rank, 2, seed=0, drop_last=False, limit_samples=29) for rank in (0, 1)]
    assert [[len(batch) for batch in sampler] for sampler in ranks] == [[6, 6, 3], [6, 6, 2]]
    assert sorted(i for sampler in ranks for batch in sampler for i in batch) == sorted(i for b in single for i in b)
    whole = GlobalBatchSampler(100, 12, 0, 1, seed=0, drop_last=True, limit_samples=29)
    assert [len(batch) for batch in whole] == [12, 12]


def test_limit_train_samples_below_a_batch_with_drop_last_is_one_line(run_refused):
    refused = run_refused("trainer.limit_train_samples=10", "data.batch_size=64")
    assert bad_input_line(refused).endswith(
        "trainer.limit_train_samples=10: fewer than data.batch_size=64; with data.drop_last=true an epoch would have "
        "no step (set data.drop_last=false)"
    )
