"""An incomplete last batch (data.drop_last=false), split over ranks and micro-batches: every strategy and every
accumulation computes single-process training's update, even when the batch has fewer rows than ranks."""

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import max_param_diff
from hydraloop.data.loaders import build_loaders
from hydraloop.data.samplers import GlobalBatchSampler

TOLERANCE = 1e-5  # float round-off, as in test_exactness.py


@pytest.mark.parametrize("num_samples, batch_size", [(103, 8), (97, 12), (7, 4), (5, 12)])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("start_sample", [0, 24])
def test_global_batches_are_slices_of_one_order_and_every_rank_takes_part_in_each(
    num_samples, batch_size, world_size, start_sample
):
    batch_size = batch_size // world_size * world_size or world_size  # the launcher's rule: the ranks split it
    single = GlobalBatchSampler(num_samples, batch_size, 0, 1, seed=3, drop_last=False)
    single.set_epoch(2, start_sample=min(start_sample, num_samples))
    ranks = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(num_samples, batch_size, rank, world_size, seed=3, drop_last=False)
        sampler.set_epoch(2, start_sample=min(start_sample, num_samples))
        ranks.append(list(sampler))
    expected = list(single)
    assert all(len(batches) == len(expected) == len(single) for batches in ranks)
    for step, batch in enumerate(expected):
        position = single.start_sample + step * batch_size
        assert single.global_rows(position) == len(batch)
        # Rank r holds rows r, r + W, ... of the global batch: KeyedDropout's row r + W*j.
        assert [rank_batches[step] for rank_batches in ranks] == [batch[rank::world_size] for rank in range(world_size)]
    everything = [index for batch in expected for index in batch]
    assert len(everything) == len(set(everything)) == num_samples - single.start_sample  # no padding, nothing left


def test_a_rank_without_rows_of_the_last_batch_gets_an_empty_batch_of_the_same_structure():
    """5 samples, 4 per batch, 2 ranks: the last global batch holds 1 row, rank 1 none of it."""
    dataset = TensorDataset(torch.randn(5, 3), torch.arange(5))
    for on_device in (False, True):
        train, _ = build_loaders(
            *(dataset, dataset),
            global_batch_size=4,
            global_val_batch_size=4,
            rank=1,
            world_size=2,
            seed=0,
            num_workers=0,
            drop_last=False,
            device=torch.device("cpu"),
            on_device=on_device,
        )
        batches = list(train)
        assert len(batches) == len(train) == 2
        assert [len(targets) for _, targets in batches] == [2, 0]
        assert batches[1][0].shape == (0, 3) and batches[1][1].dtype == torch.int64


UNEVEN = (
    "data=synthetic",
    "data.dataset.num_train=257",  # 4 batches of 64 and one of 1 row: fewer than the ranks, or the micro-batches
    "data.dataset.num_val=64",
    "data.drop_last=false",
    "optimizer=sgd",
    "model.dropout=0.2",  # KeyedDropout, keyed by each sample's row in the global batch
    "trainer.max_epochs=2",
    "logger=none",
)


@pytest.mark.slow
def test_an_uneven_last_batch_under_accumulation_ddp_and_fsdp_trains_what_single_trains(run_train):
    single = run_train(*UNEVEN)
    assert single.returncode == 0, single.output
    assert single.metrics["global_step"] == 10
    reference = single.checkpoint()
    for parallel in ("single", "ddp", "fsdp"):
        run = run_train(*UNEVEN, f"parallel={parallel}", "trainer.grad_accum_steps=4")
        assert run.returncode == 0, run.output
        assert max_param_diff(run.checkpoint()["model"], reference["model"]) < TOLERANCE, parallel
        assert run.metrics["val/acc"] == single.metrics["val/acc"], parallel
        assert run.metrics["train/loss"] == pytest.approx(single.metrics["train/loss"], rel=1e-5), parallel
        if parallel == "ddp":
            ddp = run
    # Every rank holds the weights rank 0 saved: validated by both ranks, they give the checkpoint's own metrics.
    evaluated = run_train("mode=eval", f"ckpt_path={ddp.run_dir / 'checkpoints' / 'last.pt'}", *UNEVEN, "parallel=ddp")
    assert evaluated.returncode == 0, evaluated.output
    assert evaluated.metrics["val/acc"] == ddp.checkpoint()["metrics"]["val/acc"]
    assert evaluated.metrics["val/loss"] == pytest.approx(ddp.checkpoint()["metrics"]["val/loss"], rel=1e-9)
