"""The GPT on text, through the real loop: it learns, and training with dropout is exact under every strategy, with
gradient accumulation, and across a stop mid-epoch; sampling reads what training wrote."""

import csv
import math
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TRAIN, bad_input_line, max_param_diff, read_checkpoint
from hydraloop.data.text import encode, read_text, unigram_entropy

# A GPT small enough for seconds per run, with dropout on: its masks must not depend on how the batch is split.
TINY = (
    "experiment=text_gpt",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.dropout=0.2",
    "data.block_size=32",
    "data.batch_size=16",
    "trainer.max_steps=12",
    "scheduler.warmup_steps=3",  # the recipe's 40 would pass the run
    "trainer.val_every_n_steps=6",
    "trainer.log_every_n_steps=3",
    "trainer.limit_val_batches=4",
    "logger=none",
)
ROUND_OFF = 1e-5


def weights(run_dir, name="last.pt"):
    return read_checkpoint(run_dir / "checkpoints" / name)["model"]


@pytest.fixture(scope="module")
def tiny_single(run_train):
    run = run_train(*TINY)
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
def test_a_gpt_run_logs_perplexity_tokens_and_validates_at_its_interval_the_epoch_end_and_the_last_step(run_train):
    """What the recipe logs, on a short run of it (its whole run, which test_experiments.py holds to its recorded
    val/loss of 2.14 nats, learns well below the validation text's unigram entropy of 3.36)."""
    run = run_train(
        "experiment=text_gpt",
        "trainer.limit_train_batches=40",
        "trainer.max_steps=50",
        "trainer.val_every_n_steps=30",
        "trainer.log_every_n_steps=7",
        "trainer.limit_val_batches=4",
        "logger=csv",
    )
    assert run.returncode == 0, run.output
    metrics = run.metrics
    assert metrics["val/loss"] < unigram_entropy(
        encode(read_text(None, "char"), run.checkpoint()["config"]["data"]["vocab"])
    )
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]))
    assert metrics["global_step"] == 50 and metrics["model/params"] == sum(
        p.numel() for p in weights(run.run_dir).values()
    )
    rows = list(csv.DictReader((run.run_dir / "metrics.csv").open()))
    logged = [row for row in rows if row.get("perf/tokens_per_sec")]
    assert logged and all(
        float(row["perf/tokens_per_sec"]) == pytest.approx(64 * float(row["perf/samples_per_sec"])) for row in logged
    )
    validated = [int(row["step"]) for row in rows if row.get("val/loss")]
    assert validated == [30, 40, 50]  # at 30 steps, at the epoch end (40 steps), and at the last step


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_gpt_with_dropout_under_ddp_and_fsdp_equals_single(run_train, tiny_single, parallel):
    run = run_train(*TINY, f"parallel={parallel}")
    assert run.returncode == 0, run.output
    assert max_param_diff(run.checkpoint()["model"], tiny_single.checkpoint()["model"]) < ROUND_OFF
    assert run.metrics["val/loss"] == pytest.approx(tiny_single.metrics["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_activation_checkpointing_with_dropout_computes_what_it_computes_without(run_train, tiny_single):
    """Each block recomputed in backward draws the masks its forward drew: alone, and under fsdp with accumulation."""
    alone = run_train(*TINY, "trainer.activation_checkpointing=true")
    sharded = run_train(
        *TINY, "trainer.activation_checkpointing=[Block]", "parallel=fsdp", "trainer.grad_accum_steps=2"
    )
    for run in (alone, sharded):
        assert run.returncode == 0, run.output
        assert max_param_diff(run.checkpoint()["model"], tiny_single.checkpoint()["model"]) < ROUND_OFF
        assert run.metrics["val/loss"] == pytest.approx(tiny_single.metrics["val/loss"], rel=1e-5)
    assert max_param_diff(alone.checkpoint()["model"], tiny_single.checkpoint()["model"]) == 0.0


def test_gpt_with_dropout_accumulating_4_micro_batches_equals_one_batch(train_in_process):
    plain, plain_dir = train_in_process(*TINY)
    accumulated, accumulated_dir = train_in_process(*TINY, "trainer.grad_accum_steps=4")
    assert max_param_diff(weights(accumulated_dir), weights(plain_dir)) < ROUND_OFF
    assert accumulated["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5)
    # Dropout is on: without it, the same run ends elsewhere.
    no_dropout, no_dropout_dir = train_in_process(*TINY, "model.dropout=0")
    assert max_param_diff(weights(no_dropout_dir), weights(plain_dir)) > 1e-3


@pytest.mark.parametrize("recipe", [TINY, ("experiment=diabetes_mlp", "model.dropout=0.2", "logger=none")])
def test_resuming_from_a_mid_epoch_checkpoint_equals_the_uninterrupted_run(train_in_process, recipe):
    """ckpt_every_n_steps writes the checkpoints a stop signal writes; any of them resumes exactly."""
    steps = ("trainer.max_steps=12", "trainer.ckpt_every_n_steps=5", "trainer.keep_last_k=10")
    uninterrupted, run_dir = train_in_process(*recipe, *steps)
    checkpoint = run_dir / "checkpoints" / "step-00000005.pt"
    assert read_checkpoint(checkpoint)["epoch_step"] == 5  # mid-epoch
    resumed, resumed_dir = train_in_process(*recipe, *steps, f"ckpt_path={checkpoint}")
    assert max_param_diff(weights(resumed_dir), weights(run_dir)) == 0.0
    assert resumed["train/loss"] == pytest.approx(uninterrupted["train/loss"], rel=1e-12)


def test_eval_of_a_language_model_checkpoint_equals_its_saved_metrics(train_in_process):
    _, run_dir = train_in_process(*TINY)
    best = run_dir / "checkpoints" / "best.pt"
    evaluated, _ = train_in_process(*TINY, "mode=eval", f"ckpt_path={best}")
    saved = read_checkpoint(best)["metrics"]
    assert {name: evaluated[name] for name in saved} == pytest.approx(saved, rel=1e-9)


@pytest.mark.slow
def test_stop_mid_epoch_then_rerun_equals_the_uninterrupted_run(run_train, train_env, tmp_path):
    recipe = (*TINY, "trainer.max_steps=40", "trainer.val_every_n_steps=null")
    command = [sys.executable, str(TRAIN), f"hydra.run.dir={tmp_path / 'run'}", *recipe]
    log = tmp_path / "run" / "train.log"
    job = subprocess.Popen(command, cwd=REPO, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (log.exists() and "step 9 |" in log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 128 + signal.SIGTERM
    stopped = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert 9 < stopped["global_step"] < 40 and stopped["epoch_step"] == stopped["global_step"]  # mid-epoch
    rerun = subprocess.run(command, cwd=REPO, env=train_env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    uninterrupted = run_train(*recipe)
    assert max_param_diff(weights(tmp_path / "run"), uninterrupted.checkpoint()["model"]) == 0.0


@pytest.mark.slow
def test_sampling_a_trained_checkpoint_repeats_with_its_seed(tiny_single, train_env):
    command = [
        sys.executable,
        str(REPO / "scripts" / "sample.py"),
        str(tiny_single.run_dir / "checkpoints" / "best.pt"),
    ]
    command += ["--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "7"]
    first, second = (subprocess.run(command, env=train_env, capture_output=True, text=True) for _ in range(2))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.startswith("ROMEO:")
    assert len(first.stdout.rstrip("\n")) >= len("ROMEO:") + 40 - 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.vocab_size=10",), "model.vocab_size=10: smaller than the data's vocabulary, data.vocab_size=73"),
        (("model.block_size=16",), "data.block_size=32: longer than the model's context, model.block_size=16"),
        (("task=classification",), "task=classification: the data are token sequences (data.vocab_size=73)"),
    ],
)
def test_a_language_model_that_does_not_fit_its_data_is_refused(run_train, overrides, message):
    assert message in bad_input_line(run_train(*TINY, *overrides))


def test_a_budget_in_tokens_sets_the_steps_and_is_refused_where_it_cannot_be_counted(run_train):
    # 16 windows of 32 tokens a step: 3000 tokens take 6 steps (the last one past it).
    run = run_train(*TINY, "trainer.max_steps=null", "trainer.max_tokens=3000")
    assert run.returncode == 0, run.output
    assert "trainer.max_tokens=3000: 6 steps of 512 tokens (16 x 32)" in run.output
    assert run.metrics["global_step"] == 6 and run.checkpoint()["config"]["trainer"]["max_steps"] == 6
    both = run_train(*TINY, "trainer.max_tokens=3000")
    assert "trainer.max_tokens=3000, trainer.max_steps=12: give one or the other" in bad_input_line(both)
    classes = run_train("trainer.max_tokens=3000")
    assert "trainer.max_tokens=3000: a positive number of tokens, for a task that counts them" in bad_input_line(
        classes
    )


def test_max_steps_below_the_steps_already_done_is_refused(run_train, tiny_single):
    ckpt = tiny_single.run_dir / "checkpoints" / "last.pt"
    line = bad_input_line(run_train(*TINY, "trainer.max_steps=5", f"ckpt_path={ckpt}"))
    assert f"trainer.max_steps=5: below the 12 steps already done (ckpt_path={ckpt})" in line


def test_resuming_on_another_vocabulary_is_refused(run_train, tiny_single, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("a different text, with its own characters: xyz!\n" * 200)
    ckpt = tiny_single.run_dir / "checkpoints" / "last.pt"
    line = bad_input_line(run_train(*TINY, f"data.dataset.path={other}", f"ckpt_path={ckpt}", "model.vocab_size=73"))
    assert f"ckpt_path={ckpt}: was trained on tokens of another vocabulary (73 characters, here 21) than " in line
    assert f"than data.dataset.path={other}, data.dataset.level=char gives (char)" in line


def test_mfu_is_the_models_flops_over_the_peak(train_in_process):
    """On the CPU with trainer.peak_tflops: perf/mfu = samples/s x FLOPs per sample / peak (one device)."""
    _, run_dir = train_in_process(*TINY, "logger=csv", "trainer.peak_tflops=0.001")
    rows = [row for row in csv.DictReader((run_dir / "metrics.csv").open()) if row.get("perf/mfu")]
    from hydraloop.models.gpt import GPT

    flops_per_sample = GPT(vocab_size=73, block_size=32, n_layer=2, n_head=2, n_embd=32).flops_per_token(32) * 32
    assert len(rows) == 4  # every 3 of 12 steps
    for row in rows:
        expected = float(row["perf/samples_per_sec"]) * flops_per_sample / 1e9
        assert float(row["perf/mfu"]) == pytest.approx(expected, rel=1e-9)
