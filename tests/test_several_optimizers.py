"""Several optimizers (optimizer=gan, each over its modules) and a task's own step (the GAN example,
experiment=ring_gan) through the real command line: ddp, fsdp, accumulation and a resume under another strategy end
with single's weights and both optimizers' states, on an epoch whose last batch is uneven; what does not fit is one
line before any rank starts."""

import csv

import pytest
import torch

from conftest import bad_input_line, max_param_diff

TOLERANCE = 1e-5  # as for DDP and FSDP's weights: per-rank mean gradients against one mean

# 1000 samples in batches of 64: 15 full steps and one of 40 rows (20 per rank; micro-batches of 16 and 4 under
# accumulation 2). n_critic=2: the discriminator steps at every step, the generator at every second.
ALTERNATING = ("task.n_critic=2",)
GAN = (
    "experiment=ring_gan",
    "data.dataset.num_train=1000",
    "data.dataset.num_val=200",
    "data.batch_size=64",
    "data.drop_last=false",
    "model.hidden_sizes=[16]",
    "trainer.max_epochs=1",
    "trainer.ckpt_every_n_steps=5",
    "trainer.keep_last_k=5",
    "logger=none",
)


def optimizer_moments(checkpoint: dict) -> dict:
    """Every optimizer's per-parameter state as one flat dict of tensors."""
    return {
        f"{name}.{index}.{key}": value
        for name, state in checkpoint["optimizer"].items()
        for index, entry in state["state"].items()
        for key, value in entry.items()
    }


@pytest.mark.slow
def test_a_gan_alternating_its_optimizers_trains_the_same_split_accumulated_and_resumed_under_fsdp(run_train):
    single = run_train(*GAN, *ALTERNATING)
    assert single.returncode == 0, single.output
    expected = single.checkpoint()
    assert set(expected["optimizer"]) == set(expected["scheduler"]) == {"generator", "discriminator"}
    steps = {name: int(state["state"][0]["step"]) for name, state in expected["optimizer"].items()}
    assert steps == {"discriminator": 16, "generator": 8}  # the task's order: the generator every second step
    halfway = single.run_dir / "checkpoints" / "step-00000005.pt"
    # The GAN's every strategy, accumulation and resume are the matrix's (test_matrix.py, one generator step a
    # step); here, the alternation across a split batch and across a resume.
    runs = {
        "ddp, accumulating": run_train(*GAN, *ALTERNATING, "parallel=ddp", "trainer.grad_accum_steps=2"),
        "resumed under fsdp": run_train(*GAN, *ALTERNATING, "parallel=fsdp", f"ckpt_path={halfway}"),
    }
    for name, run in runs.items():
        assert run.returncode == 0, name + run.output
        checkpoint = run.checkpoint()
        assert max_param_diff(checkpoint["model"], expected["model"]) < TOLERANCE, name
        assert max_param_diff(optimizer_moments(checkpoint), optimizer_moments(expected)) < TOLERANCE, name
        for metric in ("val/d_loss", "val/g_loss", "val/high_quality"):
            assert run.metrics[metric] == pytest.approx(single.metrics[metric], rel=1e-4, abs=1e-6), name + metric
    start = run_train(*GAN, *ALTERNATING, "trainer.max_steps=1", "trainer.ckpt_every_n_steps=1").checkpoint()
    assert max_param_diff(expected["model"], start["model"]) > 1e-3  # it trained


ADAM = "{_target_:torch.optim.Adam,_partial_:true,lr:0.0002,modules:[MODULE]}".replace("MODULE", "discriminator")

# The generator follows a schedule of its own (a warm-up over 3 steps); the discriminator the run's (constant).
OWN_SCHEDULE = (
    "+optimizer.generator.scheduler._target_=hydraloop.schedulers.cosine_with_warmup",
    "+optimizer.generator.scheduler._partial_=true",
    "+optimizer.generator.scheduler.warmup_steps=3",
)


# A callback that counts its gradient hooks' calls per optimizer (tests/randomness.py), drawing noise of size 0.
COUNTED_HOOKS = ("+callbacks.hooks._target_=tests.randomness.GradientNoise", "+callbacks.hooks.sigma=0.0")


def test_the_optimizers_stepped_scheduled_and_logged_are_the_tasks(run_train):
    run = run_train(
        *GAN,
        *ALTERNATING,
        *OWN_SCHEDULE,
        *COUNTED_HOOKS,
        "callbacks=[grad_norm]",
        "trainer.max_steps=3",
        "trainer.ckpt_every_n_steps=1",
        "trainer.log_every_n_steps=1",
        "logger=csv",
    )
    assert run.returncode == 0, run.output
    rows = list(csv.DictReader((run.run_dir / "metrics.csv").open()))
    lrs = [float(row[f"train/lr/{name}"]) for row in rows[:2] for name in ("generator", "discriminator")]
    assert lrs == pytest.approx([2e-4 * 2 / 3, 2e-4, 2e-4, 2e-4])  # the lr of the step after the logged one
    # The gradient hooks run once per optimizer the step takes: the generator at the second step only.
    assert run.checkpoint()["callbacks"]["hooks"]["calls"] == {
        "before_optimizer_step/discriminator": 3,
        "after_clipping/discriminator": 3,
        "before_optimizer_step/generator": 1,
        "after_clipping/generator": 1,
    }
    logged = [[name for name in ("discriminator", "generator") if row[f"train/grad_norm/{name}"]] for row in rows[:3]]
    assert logged == [["discriminator"], ["discriminator", "generator"], ["discriminator"]]
    first, second = run.checkpoint("step-00000001.pt"), run.checkpoint("step-00000002.pt")
    # Step 1 (the first of n_critic=2): the discriminator alone; the generator's weights are the initial ones.
    assert set(first["optimizer"]["generator"]["state"]) == set()
    assert max_param_diff(_part(first, "generator"), _part(second, "generator")) > 0
    # Evaluated under ddp, the checkpoint's parts give the metrics training validated it with.
    evaluated = run_train(*GAN, "mode=eval", f"ckpt_path={run.run_dir / 'checkpoints' / 'last.pt'}", "parallel=ddp")
    assert evaluated.returncode == 0, evaluated.output
    for metric in ("val/d_loss", "val/high_quality"):
        assert evaluated.metrics[metric] == pytest.approx(run.checkpoint()["metrics"][metric], rel=1e-6), metric


def _part(checkpoint: dict, prefix: str) -> dict:
    return {name: value for name, value in checkpoint["model"].items() if name.startswith(prefix)}


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["optimizer.generator.modules=[genrator]"],
            "optimizer.generator.modules: 'genrator' is no submodule of GAN (its children: generator, discriminator)",
        ),
        (
            ["optimizer.generator.modules=[generator,discriminator]"],
            "optimizer.discriminator.modules=['discriminator']: discriminator.0.weight is trained by "
            "optimizer.generator too; give each parameter one optimizer",
        ),
        (
            ["optimizer.generator.modules=[generator.0]"],
            "optimizer: no optimizer trains generator.2.weight, generator.2.bias: add its module to the modules of "
            "one of optimizer.generator, optimizer.discriminator",
        ),
        (["optimizer.generator.modules=generator"], "optimizer.generator.modules=generator: must be a list"),
        (["optimizer.generator.lr=0"], "optimizer.generator.lr=0: must be a positive finite number"),
        (["+optimizer.generator.betaz=[0.5,0.9]"], "torch.optim.Adam takes no argument 'betaz'; did you mean betas?"),
        (["optimizer.generator.betas=[0.5,1.5]"], "optimizer.generator.betas=[0.5, 1.5]: torch.optim.Adam says"),
        (
            ["+optimizer.generator.lr_scales=[[gen.*,0.1]]"],
            "optimizer.generator.lr_scales: the pattern 'gen.*' matches no parameter of GAN it trains",
        ),
        (["parallel=dataparallel"], "optimizer: several optimizers (generator, discriminator) train with"),
        (
            ["~optimizer.discriminator", f"+optimizer.critic={ADAM}"],
            "its optimizer_steps names 'discriminator', which the optimizer node does not have (it has generator, "
            "critic)",
        ),
        (
            [
                "optimizer.discriminator.modules=[discriminator.0]",
                f"+optimizer.head={ADAM.replace('MODULE', 'discriminator.2')}",
            ],
            "optimizer.head: task._target_=hydraloop.tasks.gan.AdversarialRing never steps it in its first 1000 steps",
        ),
        (["optimizer=adamw"], "its training_loss takes a loss per optimizer (optimizer=...), and the optimizer node"),
        (
            [*OWN_SCHEDULE, "+optimizer.generator.scheduler.warmup_stepz=3"],
            "optimizer.generator.scheduler.warmup_stepz=3: hydraloop.schedulers.cosine_with_warmup takes no argument",
        ),
        (
            ["task=classification"],
            "each need a loss of their own, and task._target_=hydraloop.tasks.classification.Classification has one",
        ),
    ],
)
def test_several_optimizers_that_do_not_fit_are_one_line_before_any_rank_starts(run_train, tmp_path, overrides, line):
    run = run_train(*GAN, *overrides, run_dir=tmp_path / "run")
    assert line in bad_input_line(run)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_other_optimizers_is_refused_in_one_line(run_train, tmp_path):
    plain = run_train("data=synthetic", "trainer.max_steps=2", "logger=none")
    assert plain.returncode == 0, plain.output
    path = plain.run_dir / "checkpoints" / "last.pt"
    run = run_train(*GAN, f"ckpt_path={path}", run_dir=tmp_path / "run")
    assert (
        f"ckpt_path={path}: holds the state of one optimizer, the config names optimizer.generator and "
        "optimizer.discriminator" in bad_input_line(run)
    )
    gan = run_train(*GAN, "trainer.max_steps=2")
    other = tmp_path / "other.pt"
    checkpoint = gan.checkpoint()
    checkpoint["config"]["optimizer"]["generator"]["_target_"] = "torch.optim.SGD"
    torch.save(checkpoint, other)
    run = run_train(*GAN, f"ckpt_path={other}", run_dir=tmp_path / "run2")
    assert f"optimizer.generator._target_=torch.optim.Adam: ckpt_path={other} holds torch.optim.SGD state" in (
        bad_input_line(run)
    )
    path = gan.run_dir / "checkpoints" / "last.pt"
    swapped = ("optimizer.generator.modules=[discriminator]", "optimizer.discriminator.modules=[generator]")
    run = run_train(*GAN, *swapped, f"ckpt_path={path}", run_dir=tmp_path / "run3")
    assert (
        f"optimizer.generator.modules=['discriminator']: ckpt_path={path} holds its state for the modules "
        "['generator']" in bad_input_line(run)
    )


def test_a_non_finite_pass_skips_the_step_for_every_optimizer_after_it(run_train):
    """Row 50 is NaN: step 2's discriminator loss is NaN. The generator must not train against the discriminator
    that step left as it was: both skip it."""
    ring = ("data.dataset._target_=tests.faults.nan_ring", "+data.dataset.nan_rows=[50]", "data.shuffle=false")
    run = run_train(
        *GAN, *ring, *COUNTED_HOOKS, "data.batch_size=42", "trainer.nonfinite_loss=skip", "trainer.max_steps=6"
    )
    assert run.returncode == 0, run.output
    assert run.metrics["skipped_steps"] == 1
    steps = {name: int(state["state"][0]["step"]) for name, state in run.checkpoint()["optimizer"].items()}
    assert steps == {"discriminator": 5, "generator": 5}
    # Nor do the callbacks' gradient hooks see the skipped step's gradients.
    calls = run.checkpoint()["callbacks"]["hooks"]["calls"]
    assert calls == {f"{hook}/{name}": 5 for hook in ("before_optimizer_step", "after_clipping") for name in steps}
