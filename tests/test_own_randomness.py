"""A user's own randomness (issue 47): data sets built from the seed in every process, per-sample draws keyed by what
they act on (hydraloop.keyed_random), and a run that says when its code draws per rank (hydraloop.draw_watch).
A loss over the global batch is the matrix's `simclr` model (tests/test_matrix.py); the worked examples' check is
tests/test_readme_example.py's."""

import json

import pytest
import torch

from conftest import max_param_diff
from hydraloop import keyed_random as keyed
from hydraloop.keyed_dropout import KeyedDropout, dropped_lanes, keep_scale
from hydraloop.row_keys import RowKeys

CPU = torch.device("cpu")


def draws(world_size: int, rank: int, first_row: int, rows: int) -> dict[str, torch.Tensor]:
    """Every kind of keyed draw for a (micro-)batch of `rows` rows at step 5, on `rank` of `world_size`."""
    with RowKeys(seed=3, rank=rank, world_size=world_size, device=CPU)(5, first_row, rows):
        return {
            "normal": keyed.normal((rows, 3, 4), key="noise"),
            "uniform": keyed.uniform((rows, 2), key=("u", 1)),
            "integers": keyed.integers(0, 1000, (rows,), key="t"),
            "bernoulli": keyed.bernoulli(0.3, (rows, 5), key="mask"),
            "permutation": keyed.permutation(rows, 6, key="order"),
            "random_mask": keyed.random_mask(rows, 10, 0.3, key="mae"),
        }


@pytest.mark.fast
def test_a_sample_draws_the_same_numbers_in_one_process_on_any_rank_and_in_any_micro_batch():
    whole = draws(1, 0, 0, 8)
    ranks = [draws(2, rank, 0, 4) for rank in (0, 1)]  # rank r holds global rows r, r + 2, ...
    micro_batches = [draws(1, 0, first, 4) for first in (0, 4)]
    uneven = [draws(3, rank, 1, rows) for rank, rows in ((0, 2), (1, 1), (2, 1))]  # a last batch, second micro-batch
    for name, numbers in whole.items():
        assert torch.equal(numbers[0::2], ranks[0][name]) and torch.equal(numbers[1::2], ranks[1][name]), name
        assert torch.equal(numbers, torch.cat([part[name] for part in micro_batches])), name
        # rows 3..7 of the global batch under 3 ranks from local row 1: global 3 + 3j, 4, 5
        assert torch.equal(numbers[[3, 6]], uneven[0][name]) and torch.equal(numbers[[4]], uneven[1][name]), name
    assert not torch.equal(whole["normal"], draws(1, 0, 0, 8)["normal"].neg()), "keyed, not constant"
    other_step = RowKeys(seed=3, rank=0, world_size=1, device=CPU)(6, 0, 8)
    with other_step:
        assert not torch.equal(keyed.normal((8, 3, 4), key="noise"), whole["normal"])


@pytest.mark.fast
def test_keyed_draws_have_the_distributions_they_name():
    with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(0, 0, 2048):
        normal = keyed.normal((2048, 128), key=1)
        uniform = keyed.uniform((2048, 128), key=2)
        integers = keyed.integers(-3, 7, (2048, 128), key=3)
        kept = keyed.bernoulli(0.25, (2048, 128), key=4)
        mask = keyed.random_mask(2048, 16, 0.75, key=5)
        order = keyed.permutation(2048, 16, key=6)
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01
    assert abs((normal**4).mean() - 3) < 0.05  # Gaussian tails, not uniform ones
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.005
    counts = torch.bincount((integers + 3).flatten(), minlength=10).float()
    assert integers.min() == -3 and integers.max() == 6 and (counts / counts.mean() - 1).abs().max() < 0.03
    assert abs(kept.float().mean() - 0.25) < 0.005
    assert (mask.sum(dim=1) == 12).all() and abs(mask.float().mean(dim=0) - 0.75).max() < 0.05
    assert (order.sort(dim=1).values == torch.arange(16)).all()


@pytest.mark.fast
def test_outside_the_loop_keyed_draws_are_torchs_and_a_wrong_shape_is_one_line():
    torch.manual_seed(0)
    expected = torch.randn(3, 2)
    torch.manual_seed(0)
    assert torch.equal(keyed.normal((3, 2), key="x"), expected)
    for shape in [(3, 2), (8, 2)]:  # one pattern for a batch of 8 would be another on each rank: not a multiple either
        with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(0, 0, 4), pytest.raises(ValueError) as error:
            keyed.normal(shape, key="x")
        assert str(error.value).startswith(f"a keyed draw of shape {shape}: its first dimension must be the batch's 4")
    with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(0, 0, 1 << 16):
        for dtype in (torch.bfloat16, torch.float16):  # as many random bits as the dtype holds: never 1.0
            assert keyed.uniform((1 << 16, 16), key=("u", str(dtype)), dtype=dtype).max() < 1


@pytest.mark.fast
def test_keyed_dropout_scales_by_the_keep_rate_its_masks_have():
    assert dropped_lanes(0.1) == 6554 and keep_scale(0.1) == 65536 / (65536 - 6554)
    assert dropped_lanes(2**-18) == 0 and keep_scale(2**-18) == 1.0  # no drop at 2**-16 for a p far below it
    with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(0, 0, 4096):
        mean = KeyedDropout(0.1, key=1).train()(torch.ones(4096, 256, dtype=torch.float64)).mean()
    assert abs(mean - 1) < 2e-3  # unbiased: the kept elements' scale matches the masks' keep rate


# The training set of split_blobs (tests/own_randomness.py), 180 samples, in batches of 24 with a last one of 12.
BLOBS = ["data.dataset._target_=tests.own_randomness.split_blobs", "data.input_shape=[8]", "data.num_classes=4"]
BLOBS += ["data.batch_size=24", "data.drop_last=false", "trainer.max_epochs=2", "logger=none"]


@pytest.mark.slow
def test_a_random_split_draws_the_same_samples_in_every_process_and_every_run(run_train, tmp_path):
    record = tmp_path / "indices.jsonl"
    runs = {
        name: run_train(*BLOBS, f"+data.dataset.record={record}", *overrides)
        for name, overrides in {
            "single": [],
            "again": [],
            "fork": ["parallel=ddp", "parallel.start_method=fork"],
            "spawn": ["parallel=ddp", "parallel.start_method=spawn"],
        }.items()
    }
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.output)
    built = [json.loads(line) for line in record.read_text().splitlines()]
    # The launcher and the rank (single), twice; the launcher and each of 2 ranks, forked and spawned.
    assert len(built) == 2 * 2 + 2 * 3 and len({entry["pid"] for entry in built}) >= 8
    assert all(entry["indices"] == built[0]["indices"] for entry in built)
    metrics = {name: run.metrics for name, run in runs.items()}
    assert metrics["single"]["val/loss"] == metrics["again"]["val/loss"]
    assert metrics["fork"]["val/loss"] == metrics["spawn"]["val/loss"]
    assert abs(metrics["fork"]["val/loss"] - metrics["single"]["val/loss"]) < 1e-6


@pytest.mark.slow
def test_noise_a_task_draws_per_rank_is_said_and_keyed_noise_is_exact(run_train):
    plain = run_train(*BLOBS, "task._target_=tests.own_randomness.NoisyInputs", "+task.keyed=false", "parallel=ddp")
    assert plain.returncode == 0, plain.output
    said = [line for line in plain.log.splitlines() if "this run is not exact" in line]
    assert len(said) == 1, plain.log  # once, for every rank
    assert (
        "2 rank(s) drew from torch's default generator while the batch is split (2 ranks); rank 0 first at step 0"
        in said[0]
    )
    assert "torch.randn_like at tests/own_randomness.py:" in said[0] and "(training_loss)" in said[0]
    keyed_runs = [
        run_train(*BLOBS, "task._target_=tests.own_randomness.NoisyInputs", *overrides)
        for overrides in ([], ["parallel=ddp", "trainer.grad_accum_steps=3"])
    ]
    for run in keyed_runs:
        assert run.returncode == 0 and "not exact" not in run.log, run.output
    single, ddp = (run.checkpoint()["model"] for run in keyed_runs)
    assert max_param_diff(single, ddp) < 1e-5
    assert max_param_diff(single, plain.checkpoint()["model"]) > 1e-3  # the per-rank draws trained other weights
