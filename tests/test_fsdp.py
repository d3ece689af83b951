"""parallel=fsdp computes what single-process training computes, and its checkpoints resume under any strategy."""

import math

import pytest
import torch

from conftest import max_param_diff
from test_bad_input import assert_rejected

TOLERANCE = 1e-5  # as for DDP: FSDP averages per-rank mean gradients, single takes one mean
# 359 validation samples in global batches of 358: rank 0's shard (180 samples) has 2 batches, rank 1's (179)
# has 1. Every FSDP forward pass is a collective, so this would hang if ranks ran different numbers of them.
UNEVEN_VAL = ("data.val_batch_size=358", "logger=none")


def moments(run) -> dict:
    """AdamW's second moments in last.pt, keyed by parameter position."""
    return {k: v["exp_avg_sq"] for k, v in run.checkpoint()["optimizer"]["state"].items()}


@pytest.fixture(scope="module")
def single_2_epochs(run_train):
    run = run_train("trainer.max_epochs=2", *UNEVEN_VAL)
    assert run.returncode == 0, run.output
    return run


@pytest.fixture(scope="module")
def fsdp_2_epochs(run_train):
    run = run_train("parallel=fsdp", "trainer.max_epochs=2", *UNEVEN_VAL)
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
@pytest.mark.fast  # the fast tier's one fsdp-equals-single
def test_fsdp_two_ranks_matches_single(single_2_epochs, fsdp_2_epochs):
    single, fsdp = single_2_epochs, fsdp_2_epochs
    assert fsdp.metrics["world_size"] == 2
    assert fsdp.metrics["global_step"] == single.metrics["global_step"] == 44
    # The checkpoint holds the full weights and the optimizer state keyed as a plain optimizer keys it.
    assert max_param_diff(fsdp.checkpoint()["model"], single.checkpoint()["model"]) < TOLERANCE
    assert fsdp.checkpoint()["optimizer"]["param_groups"] == single.checkpoint()["optimizer"]["param_groups"]
    assert max_param_diff(moments(fsdp), moments(single)) < 1e-6
    assert fsdp.metrics["val/acc"] == single.metrics["val/acc"]
    assert fsdp.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-6)
    assert fsdp.metrics["train/loss"] == pytest.approx(single.metrics["train/loss"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_matches_single_with_clipping_accumulation_and_nested_units(run_train, single_2_epochs):
    """Clipping by the norm over all shards, gradients accumulated unsharded over micro-batches, and each
    Linear a unit inside the Sequential unit."""
    overrides = ("trainer.max_epochs=2", "trainer.grad_clip_norm=0.5", "trainer.grad_accum_steps=2", *UNEVEN_VAL)
    single = run_train(*overrides)
    units = ("parallel.shard_modules=[Linear,Sequential]", "parallel.reshard_after_forward=false")
    fsdp = run_train(*overrides, "parallel=fsdp", *units)
    assert single.returncode == 0, single.output
    assert fsdp.returncode == 0, fsdp.output
    assert max_param_diff(single.checkpoint()["model"], single_2_epochs.checkpoint()["model"]) > 1e-3  # it clipped
    assert max_param_diff(fsdp.checkpoint()["model"], single.checkpoint()["model"]) < TOLERANCE
    assert fsdp.metrics["val/acc"] == single.metrics["val/acc"]


@pytest.mark.slow
def test_resume_across_single_and_fsdp(run_train, single_2_epochs):
    """An FSDP checkpoint resumes under single and a single checkpoint under FSDP, weights and AdamW moments,
    each ending where the uninterrupted single run ends."""
    fsdp_1 = run_train("parallel=fsdp", "trainer.max_epochs=1", *UNEVEN_VAL)
    single_1 = run_train("trainer.max_epochs=1", *UNEVEN_VAL)
    assert fsdp_1.returncode == 0, fsdp_1.output
    assert single_1.returncode == 0, single_1.output
    to_single = run_train("trainer.max_epochs=2", f"ckpt_path={fsdp_1.run_dir}/checkpoints/last.pt", *UNEVEN_VAL)
    to_fsdp = run_train(
        "parallel=fsdp", "trainer.max_epochs=2", f"ckpt_path={single_1.run_dir}/checkpoints/last.pt", *UNEVEN_VAL
    )
    for resumed in (to_single, to_fsdp):
        assert resumed.returncode == 0, resumed.output
        assert "epoch 1, step 22" in resumed.output
        assert max_param_diff(resumed.checkpoint()["model"], single_2_epochs.checkpoint()["model"]) < TOLERANCE
        assert max_param_diff(moments(resumed), moments(single_2_epochs)) < 1e-6
        assert resumed.metrics["val/acc"] == single_2_epochs.metrics["val/acc"]


@pytest.mark.slow
def test_fsdp_evaluates_a_single_checkpoint(run_train, single_2_epochs):
    path = single_2_epochs.run_dir / "checkpoints" / "last.pt"
    run = run_train("parallel=fsdp", "mode=eval", f"ckpt_path={path}", *UNEVEN_VAL)
    assert run.returncode == 0, run.output
    saved = single_2_epochs.checkpoint()["metrics"]
    assert run.metrics["val/acc"] == saved["val/acc"]
    assert run.metrics["val/loss"] == pytest.approx(saved["val/loss"], rel=1e-6)


@pytest.mark.slow
def test_bfloat16_compute_trains_close_to_float32(run_train, fsdp_2_epochs):
    run = run_train("parallel=fsdp", "parallel.param_dtype=bfloat16", "trainer.max_epochs=2", *UNEVEN_VAL)
    assert run.returncode == 0, run.output
    loss, reference = run.metrics["train/loss"], fsdp_2_epochs.metrics["train/loss"]
    assert math.isfinite(loss) and loss == pytest.approx(reference, abs=0.05)
    assert run.metrics["val/acc"] == pytest.approx(fsdp_2_epochs.metrics["val/acc"], abs=0.03)
    weights = run.checkpoint()["model"]
    assert max_param_diff(weights, fsdp_2_epochs.checkpoint()["model"]) > 0  # computed in bfloat16: not exact
    # The sharded weights and the optimizer stay float32; only forward and backward ran in bfloat16.
    assert {tensor.dtype for tensor in [*weights.values(), *moments(run).values()]} == {torch.float32}


def test_bad_mixed_precision_dtype(run_train):
    run = run_train("parallel=fsdp", "parallel.param_dtype=float16")
    assert_rejected(run, "parallel.param_dtype=float16: must be null, float32 or bfloat16")


def test_shard_module_that_matches_nothing(run_train):
    """Checked in the launcher on a model built on the meta device: no rank starts."""
    run = run_train("parallel=fsdp", "parallel.shard_modules=[Linear,Block]", "trainer.max_epochs=1")
    assert_rejected(run, "parallel.shard_modules=['Linear', 'Block']: Block matches no module of MLP")
    assert "[rank 1]" not in run.output and "run directory:" not in run.output


@pytest.mark.slow
def test_built_on_the_meta_device_each_rank_computes_with_rank_0s_values(run_train):
    """Ranks other than 0 build the model on the meta device: they take rank 0's parameters, persistent buffers and
    a buffer that no state_dict holds (drawn by the constructor), and so train what single-process training trains."""
    model = ("model._target_=tests.structured.WithComputedBuffer", "trainer.max_steps=8", "logger=none")
    single = run_train(*model)
    fsdp = run_train(*model, "parallel=fsdp")
    assert single.returncode == 0, single.output
    assert fsdp.returncode == 0, fsdp.output
    # The buffer shifts every input by about 1: round-off lands ddp 1.6e-5 from single after 8 steps, and fsdp
    # exactly on ddp; a rank computing with a buffer of its own draw lands 4.6e-2 away.
    assert max_param_diff(fsdp.checkpoint()["model"], single.checkpoint()["model"]) < 1e-4
    assert fsdp.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_hybrid_sharding_two_copies_over_two_ranks_each_equals_single(run_train):
    """parallel.replicate=2 with 4 ranks: a 2 x 2 mesh, each copy sharded over 2 ranks, gradients averaged over all."""
    one_epoch = ("trainer.max_epochs=1", "logger=none")
    single = run_train(*one_epoch)
    hybrid = run_train(*one_epoch, "parallel=fsdp", "parallel.nproc_per_node=4", "parallel.replicate=2")
    assert single.returncode == 0, single.output
    assert hybrid.returncode == 0, hybrid.output
    assert hybrid.metrics["world_size"] == 4
    assert max_param_diff(hybrid.checkpoint()["model"], single.checkpoint()["model"]) < TOLERANCE
    assert hybrid.metrics["val/acc"] == single.metrics["val/acc"]
