"""callbacks=[ema] through the real command line: the average is the hand-computed one of the saved weights, it is
validated as val/ema/<metric>, chooses best.pt, evaluates with ckpt_weights=ema, and is the same after a resume under
another strategy (with parameter groups, which must survive that resume too; ddp, fsdp and accumulation: the matrix); a
model with tied weights is validated, evaluated and loaded for prediction with its whole average, under fsdp too,
which keeps validation's gathered weights with reshard_after_forward=false."""

import csv

import pytest
import torch
from hydra.utils import instantiate

from conftest import bad_input_line, compose_train, max_param_diff
from hydraloop.parallel.single import SingleDevice
from hydraloop.restore import load_weights
from hydraloop.seeding import seed_everything

TOLERANCE = 1e-5  # as for DDP and FSDP's weights: per-rank mean gradients against one mean


def averaged(checkpoint: dict) -> dict:
    return checkpoint["callbacks"]["ema"]["weights"]


def test_the_average_is_the_hand_computed_one_and_is_validated_saved_and_evaluated(run_train, tmp_path):
    overrides = (
        "callbacks=[ema]",
        "callbacks.ema.decay=0.9",
        "callbacks.ema.every_n_steps=2",
        "trainer.max_steps=7",  # ends mid-epoch, on a step without an update
        "trainer.val_every_n_steps=3",
        "optimized_metric=val/ema/loss",
    )
    run = run_train(
        *overrides, "trainer.ckpt_every_n_steps=1", "trainer.keep_last_k=10", "trainer.eval_best=true", "logger=csv"
    )
    assert run.returncode == 0, run.output
    seed_everything(0)  # as src/train.py builds the model: the first weights, which the average starts from
    expected = dict(instantiate(compose_train(*overrides).model).named_parameters())
    steps = {step: run.checkpoint(f"step-{step:08d}.pt") for step in range(1, 8)}
    updates = 0
    for step, checkpoint in steps.items():
        if step % 2 == 0:  # every second optimizer step: decay min(0.9, (1 + k) / (10 + k)) for the k-th update
            decay = min(0.9, (1 + updates) / (10 + updates))
            expected = {
                name: decay * value + (1 - decay) * checkpoint["model"][name] for name, value in expected.items()
            }
            updates += 1
        assert max_param_diff(averaged(checkpoint), expected) < 1e-6, step
        assert checkpoint["callbacks"]["ema"]["updates"] == updates
    assert max_param_diff(averaged(steps[6]), averaged(steps[7])) == 0  # step 7 does not update

    # Validated beside the raw weights; best.pt chosen by the average's loss; eval_best evaluates best.pt's average.
    rows = [row for row in csv.DictReader((run.run_dir / "metrics.csv").open()) if row.get("val/ema/loss")]
    assert [int(row["step"]) for row in rows] == [3, 6, 7]
    best = run.checkpoint("best.pt")
    assert best["metrics"]["val/ema/loss"] == pytest.approx(min(float(row["val/ema/loss"]) for row in rows))
    assert run.metrics["best/val/ema/loss"] == pytest.approx(best["metrics"]["val/ema/loss"], rel=1e-9)
    assert run.metrics["val/ema/loss"] != pytest.approx(run.metrics["val/loss"])  # another set of weights

    # mode=eval with the average gives the metrics training validated it with.
    last = run.run_dir / "checkpoints" / "last.pt"
    evaluated = run_train("mode=eval", f"ckpt_path={last}", "ckpt_weights=ema", "logger=none")
    assert evaluated.returncode == 0, evaluated.output
    assert evaluated.metrics["val/loss"] == pytest.approx(run.checkpoint()["metrics"]["val/ema/loss"], rel=1e-9)

    # A checkpoint without an average: ckpt_weights=ema is refused in the launcher.
    plain = tmp_path / "plain.pt"
    torch.save({**run.checkpoint(), "callbacks": {}}, plain)
    refused = run_train("mode=eval", f"ckpt_path={plain}", "ckpt_weights=ema", "logger=none", run_dir=tmp_path / "r")
    assert f"ckpt_weights=ema: ckpt_path={plain} holds no weights of callbacks.ema" in bad_input_line(refused)
    assert not (tmp_path / "r").exists()


# Parameter groups (no decay on biases, the first layer at half the lr) ride along: they too must survive the resume.
EXACT = (
    "callbacks=[ema]",
    "callbacks.ema.decay=0.8",
    "optimizer.weight_decay=0.1",
    "optimizer.no_weight_decay=true",
    "optimizer.lr_scales=[[net.1.*,0.5]]",
    "trainer.max_steps=8",
    "trainer.ckpt_every_n_steps=4",
    "trainer.keep_last_k=5",
    "logger=none",
)


@pytest.mark.slow
def test_the_average_and_parameter_groups_resumed_under_fsdp_are_the_uninterrupted_runs(run_train):
    """The average under ddp, fsdp, accumulation and a resume is the matrix's (test_matrix.py); here, with parameter
    groups, which must survive the resume under another strategy too."""
    single = run_train(*EXACT)
    assert single.returncode == 0, single.output
    halfway = single.run_dir / "checkpoints" / "step-00000004.pt"
    runs = {"resumed under fsdp": run_train(*EXACT, "parallel=fsdp", f"ckpt_path={halfway}")}
    expected = single.checkpoint()
    for name, run in runs.items():
        assert run.returncode == 0, name + run.output
        checkpoint = run.checkpoint()
        assert max_param_diff(averaged(checkpoint), averaged(expected)) < TOLERANCE, name
        assert max_param_diff(checkpoint["model"], expected["model"]) < TOLERANCE, name
        assert checkpoint["callbacks"]["ema"]["updates"] == 8, name
        assert run.metrics["val/ema/loss"] == pytest.approx(single.metrics["val/ema/loss"], rel=1e-5), name
        groups = [
            (group["lr"], group["weight_decay"], len(group["params"]))
            for group in checkpoint["optimizer"]["param_groups"]
        ]
        assert groups == [
            (group["lr"], group["weight_decay"], len(group["params"]))
            for group in expected["optimizer"]["param_groups"]
        ]
    assert max_param_diff(averaged(expected), expected["model"]) > 1e-3  # an average, not the weights


def test_a_step_skipped_for_a_non_finite_loss_does_not_move_the_average(run_train):
    run = run_train(
        "callbacks=[ema]",
        "model._target_=tests.faults.NaNMLP",
        "+model.fail_rank=0",
        "+model.fail_at_step=3",
        "trainer.nonfinite_loss=skip",
        "trainer.max_steps=5",
        "trainer.ckpt_every_n_steps=1",
        "trainer.keep_last_k=10",
        "logger=none",
    )
    assert run.returncode == 0, run.output
    assert run.metrics["skipped_steps"] == 1
    steps = [run.checkpoint(f"step-{step:08d}.pt") for step in range(1, 6)]
    assert [checkpoint["callbacks"]["ema"]["updates"] for checkpoint in steps] == [1, 2, 2, 3, 4]
    assert max_param_diff(steps[2]["model"], steps[1]["model"]) == 0  # the skipped step: no update...
    assert max_param_diff(averaged(steps[2]), averaged(steps[1])) == 0  # ...and no average of it


# A tiny Hugging Face GPT-2 on the bundled characters: its output layer is its input embeddings (tied, as in every
# transformers causal language model), one parameter that the average holds once, under its first name.
TIED = (
    "data=text",
    "data.block_size=32",
    "data.batch_size=12",
    "model=hf",
    "model.model_type=gpt2",
    "+model.config.n_layer=2",
    "+model.config.n_embd=32",
    "+model.config.n_head=2",
    "+model.config.n_positions=32",
    "task=language_model",
    "optimizer=sgd",
    "optimizer.lr=0.5",
    "callbacks=[ema]",
    "callbacks.ema.decay=0.8",
    "trainer.max_steps=8",
    "trainer.limit_val_batches=4",
    "logger=none",
)


@pytest.fixture(scope="module")
def tied_single(run_train):
    run = run_train(*TIED)
    assert run.returncode == 0, run.output
    return run


def test_a_tied_models_average_is_evaluated_with_its_tied_weight_averaged(train_in_process, tied_single):
    checkpoint = tied_single.checkpoint()
    assert "lm_head.weight" in checkpoint["model"] and "lm_head.weight" not in averaged(checkpoint)
    last = tied_single.run_dir / "checkpoints" / "last.pt"
    evaluated, _ = train_in_process(*TIED, "mode=eval", f"ckpt_path={last}", "ckpt_weights=ema")
    assert evaluated["val/loss"] == pytest.approx(tied_single.metrics["val/ema/loss"], rel=1e-9)

    # mode=predict loads the weights as mode=eval does (its next tokens, of a model this young, are the same either
    # way): the model training validated as the average, its weights written in place, the tied layer's too.
    expected = instantiate(checkpoint["config"]["model"])
    expected.load_state_dict(checkpoint["model"])
    with torch.no_grad():
        for name, average in averaged(checkpoint).items():
            expected.get_parameter(name).copy_(average)
    loaded = instantiate(checkpoint["config"]["model"])
    load_weights(last, SingleDevice("cpu"), loaded, "ema")
    assert max_param_diff(loaded.state_dict(), expected.state_dict()) == 0


@pytest.mark.slow
def test_under_fsdp_a_tied_models_average_is_validated_and_evaluated_as_on_one_process(run_train, tied_single):
    # reshard_after_forward=false: a validation's forward leaves the units gathered, and the next forward reads the
    # gathered copies. Validations mid-run without a checkpoint after them (whose state_dict would reshard): were the
    # average left gathered after one, the next steps would train it, and val/loss would differ too.
    kept_gathered = run_train(
        *TIED,
        "parallel=fsdp",
        "parallel.reshard_after_forward=false",
        "trainer.val_every_n_steps=3",
        "trainer.save_checkpoints=false",
    )
    assert kept_gathered.returncode == 0, kept_gathered.output
    for name in ("val/loss", "val/ema/loss", "val/ema/acc"):
        assert kept_gathered.metrics[name] == pytest.approx(tied_single.metrics[name], rel=1e-5), name
    assert tied_single.metrics["val/ema/loss"] != pytest.approx(tied_single.metrics["val/loss"], rel=1e-4)

    last = f"ckpt_path={tied_single.run_dir / 'checkpoints' / 'last.pt'}"
    evaluated = run_train(*TIED, "parallel=fsdp", "mode=eval", last, "ckpt_weights=ema")
    assert evaluated.returncode == 0, evaluated.output
    assert evaluated.metrics["val/loss"] == pytest.approx(tied_single.metrics["val/ema/loss"], rel=1e-5)
