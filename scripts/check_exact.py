"""Does your setup compute under ddp, fsdp, accumulation and a resume what it computes in one process? One command:

    python scripts/check_exact.py experiment=digits_mlp
    python scripts/check_exact.py python src/train.py model=my_model data=my_data callbacks=[ema] optimizer.lr=1e-3

takes a training command line (your model, data, task, optimizer and callbacks) and runs it for a few steps, one run
after another: under single (the reference), ddp and fsdp with 2 ranks, ddp with gradient accumulation (3 micro-batches,
or 2 or 4 where the batch splits so) over an epoch whose last batch is smaller than the ranks' micro-batches, and fsdp
stopped by a stop signal mid-epoch and resumed under single. It then prints one table: per row, the largest
difference from single of the parameters, the optimizer state, the callbacks' state and the metrics
(hydraloop.exactness: relative to the largest value of their kind), pass or fail at the tolerance, and the first entry
beyond it. Exit 0 when every row passes, 1 when one fails, 2 when the command itself is refused.

What it sets, the same for every row so that they train the same samples: `trainer.limit_train_samples` (an epoch of
2 batches and one of a few rows) with `data.drop_last=false`, 5 steps, validation limited to 4 batches, logging every
step to metrics.csv (compared too), and a warm-up shortened to fit the 5 steps. The runs go to a temporary folder,
removed when every row passes (`--out DIR` keeps them).
"""

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "src" / "train.py"

# Set by the check for every row; the command's own values of these are dropped.
OWN_KEYS = (
    "parallel",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_tokens",
    "trainer.grad_accum_steps",
    "trainer.limit_train_samples",
    "trainer.log_every_n_steps",
    "trainer.save_checkpoints",
    "data.drop_last",
    "logger",
    "resume",
    "mode",
    "hydra.run.dir",
)
STEPS, FULL_BATCHES, STOP_AFTER, VAL_BATCHES = 5, 2, 2, 4
ROWS = ("ddp", "fsdp", "accumulation", "resume")


@dataclass
class Plan:
    """The batch, accumulation and epoch every row trains with."""

    batch_size: int
    accumulation: int
    last_rows: int
    overrides: list[str]
    notes: list[str]


@dataclass
class Row:
    label: str
    legs: list[list[str]]  # one command's overrides, or a stopped one's and its resume's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the ddp and fsdp rows (default 2)")
    parser.add_argument("--tolerance", type=float, help="relative; default by trainer.precision (float32: 1e-4)")
    parser.add_argument(
        "--out", type=Path, help="keep the runs in this folder (default: a temporary one, kept on failure)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=ROWS,
        default=list(ROWS),
        help=f"rows to run besides single (default: {' '.join(ROWS)})",
    )
    parser.usage = "%(prog)s [options] [python src/train.py] OVERRIDES..."
    args, command = parser.parse_known_args(argv)
    overrides, dropped = own_overrides(command)

    from hydraloop import exactness
    from hydraloop.errors import BAD_INPUT_EXIT_CODE, ConfigError

    try:
        cfg = composed(overrides)
        plan = make_plan(cfg, args.ranks)
    except ConfigError as error:
        print(f"check_exact.py: {error}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    tolerance = args.tolerance or exactness.TOLERANCES[str(cfg.trainer.precision)]
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        print(f"check_exact.py: --out={args.out}: not empty; name a new folder", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    out = args.out or Path(tempfile.mkdtemp(prefix="check_exact-"))
    rows = {name: row for name, row in make_rows(overrides, plan, args.ranks).items() if name in ("single", *args.rows)}
    print(f"checking: {' '.join(overrides) or '(the defaults)'}")
    for note in [*(f"{key} is the check's to set: dropped" for key in dropped), *plan.notes]:
        print(f"  {note}")
    print(f"  tolerance {tolerance:g} relative (trainer.precision={cfg.trainer.precision}); runs in {out}")

    results: list[tuple[str, exactness.Comparison | exactness.Outcome | None]] = []
    reference_dir = out / "single"
    for name, row in rows.items():
        run_dir = out / name
        start = time.monotonic()
        outcome = run_row(row, run_dir, args.timeout)
        print(f"  {row.label}: {time.monotonic() - start:.0f} s", flush=True)
        if name == "single":
            if outcome is not None:
                print(f"the single-process run did not finish: {outcome.text}", file=sys.stderr)
                return BAD_INPUT_EXIT_CODE if outcome.result == "refused" else 1
            results.append((row.label, None))
            continue
        results.append((row.label, outcome or exactness.compare_runs(reference_dir, run_dir, tolerance)))
    print(exactness.table(results))
    failed = any(
        isinstance(outcome, exactness.Outcome)
        and outcome.result != "refused"
        or isinstance(outcome, exactness.Comparison)
        and not outcome.passed
        for _, outcome in results
    )
    for (name, row), (_, outcome) in zip(rows.items(), results):
        if isinstance(outcome, exactness.Comparison) and not outcome.passed:
            log = out / name / "train.log"
            print(f"  {row.label}: {exactness.likely_cause(log.read_text() if log.exists() else '')}")
    if not failed and args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    elif failed:
        print(f"the runs' logs and checkpoints: {out}")
    return 1 if failed else 0


def own_overrides(command: list[str]) -> tuple[list[str], list[str]]:
    """The command's overrides, without `python src/train.py` in front and without the keys the check sets."""
    words = list(command)
    while words and (Path(words[0]).name.startswith("python") or words[0].endswith("train.py")):
        words.pop(0)
    kept, dropped = [], []
    for word in words:
        key = word.lstrip("+~").split("=", 1)[0]
        own = any(key == k or key.startswith(f"{k}.") for k in OWN_KEYS)
        if own and not key.startswith("parallel."):  # a strategy's settings go to the rows of that strategy
            dropped.append(key)
        else:
            kept.append(word)
    return kept, dropped


def composed(overrides: list[str]):
    """The command's config, resolved, as src/train.py composes it (for the data set's size and the schedule)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from hydraloop.config import register_configs
    from hydraloop.errors import ConfigError, first_line

    register_configs()
    plain = [word for word in overrides if not word.lstrip("+~").startswith("parallel.")]
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*plain, "output_dir=/unused", "log_file=/unused"])
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    except (HydraException, ValueError) as error:
        raise ConfigError(f"the command: {first_line(error)}") from None


def make_plan(cfg, ranks: int) -> Plan:
    """A batch that splits into `ranks` x the accumulation, and an epoch of FULL_BATCHES of them and a last one of
    fewer rows than ranks x accumulation (trainer.limit_train_samples), from the command's batch size."""
    from hydraloop.seeding import seeded_build

    notes = []
    task = seeded_build(cfg.task, cfg.seed)
    if task.global_batch_loss:
        notes.append(
            f"{type(task).__name__}: a loss over the global batch: its rows are gathered over the ranks, and "
            "accumulation computes them in two passes (hydraloop.global_batch)"
        )
    batch = cfg.data.batch_size
    accumulation = next((a for a in (3, 2, 4) if batch % (ranks * a) == 0), None)
    if accumulation is None:
        accumulation = 3
        batch = math.ceil(batch / (ranks * accumulation)) * ranks * accumulation
        notes.append(f"data.batch_size={batch} (was {cfg.data.batch_size}): split into {ranks} ranks x 3 micro-batches")
    train_set, _ = seeded_build(cfg.data.dataset, cfg.seed)  # as the runs build it
    last_rows = min(ranks * accumulation - 1, batch - 1) or 1
    samples = FULL_BATCHES * batch + last_rows
    if len(train_set) < samples:
        samples = len(train_set)
        last_rows = samples % batch or batch
        notes.append(f"the training set holds {samples} samples: an epoch of them, its last batch {last_rows} rows")
    epoch_steps = math.ceil(samples / batch)
    val_batch = cfg.data.val_batch_size or batch
    overrides = [
        f"data.batch_size={batch}",
        f"data.val_batch_size={math.ceil(val_batch / ranks) * ranks}",  # the same samples under every world size
        "data.drop_last=false",
        f"trainer.limit_train_samples={samples}",
        f"trainer.max_steps={STEPS}",
        "trainer.max_tokens=null",
        f"trainer.limit_val_batches={cfg.trainer.limit_val_batches or VAL_BATCHES}",
        "trainer.log_every_n_steps=1",  # a row stopped after a step stops there; every step's metrics compared
        "trainer.save_checkpoints=true",
        "logger=csv",
        "mode=train",
    ]
    scheduler = cfg.scheduler
    if scheduler.get("warmup_steps") is not None and scheduler.warmup_steps > STEPS:
        overrides.append("scheduler.warmup_steps=2")
        notes.append(f"scheduler.warmup_steps=2 (was {scheduler.warmup_steps}): within the check's {STEPS} steps")
    elif "warmup_epochs" in scheduler and round((scheduler.warmup_epochs or 1.0) * epoch_steps) > STEPS:
        overrides.append("scheduler.warmup_epochs=1")
        notes.append(f"scheduler.warmup_epochs=1 (was {scheduler.warmup_epochs}): within the check's {STEPS} steps")
    return Plan(batch, accumulation, last_rows, overrides, notes)


def make_rows(overrides: list[str], plan: Plan, ranks: int) -> dict[str, Row]:
    common = [*overrides_without_parallel(overrides), *plan.overrides]

    def under(parallel: str) -> list[str]:
        distributed = [f"parallel.nproc_per_node={ranks}"] if parallel != "single" else []
        return [*common, f"parallel={parallel}", *distributed, *parallel_settings(overrides, parallel)]

    stop = [
        "+callbacks.exactness_stop._target_=hydraloop.exactness.StopAfterStep",
        f"+callbacks.exactness_stop.step={STOP_AFTER}",
    ]
    return {
        "single": Row("single", [under("single")]),
        "ddp": Row(f"ddp, {ranks} ranks", [under("ddp")]),
        "fsdp": Row(f"fsdp, {ranks} ranks", [under("fsdp")]),
        "accumulation": Row(
            f"ddp, {ranks} ranks, accumulation {plan.accumulation}, last batch {plan.last_rows} rows",
            [[*under("ddp"), f"trainer.grad_accum_steps={plan.accumulation}"]],
        ),
        "resume": Row(
            f"fsdp stopped after step {STOP_AFTER}, resumed under single", [[*under("fsdp"), *stop], under("single")]
        ),
    }


def overrides_without_parallel(overrides: list[str]) -> list[str]:
    return [word for word in overrides if not word.lstrip("+~").startswith("parallel.")]


def parallel_settings(overrides: list[str], parallel: str) -> list[str]:
    """The command's `parallel.KEY=...` that the strategy `parallel` has (find_unused_parameters for ddp, say)."""
    from hydraloop.config import DDPConfig, FSDPConfig, SingleConfig

    schema = {"single": SingleConfig, "ddp": DDPConfig, "fsdp": FSDPConfig}[parallel]
    keys = {field.name for field in fields(schema)} - {"nproc_per_node"}
    return [word for word in overrides if word.lstrip("+~").split("=", 1)[0].removeprefix("parallel.") in keys]


def run_row(row: Row, run_dir: Path, timeout: float):
    """Runs the row's commands into `run_dir`, one after another; None when the last one finished, else an Outcome:
    `refused` with the refusal's line (exit 2), or `failed` with the run's last error line."""
    from hydraloop import exactness

    for leg, overrides in enumerate(row.legs):
        stopped = leg < len(row.legs) - 1
        command = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", *overrides]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=os.environ)
        except subprocess.TimeoutExpired:
            return exactness.Outcome("failed", f"no end within {timeout:.0f} s")
        output = proc.stdout + proc.stderr
        if proc.returncode == 2:
            return exactness.Outcome("refused", error_line(output))
        if proc.returncode != (143 if stopped else 0):  # 128 + SIGTERM: stopped as asked, with a checkpoint
            return exactness.Outcome("failed", f"exit {proc.returncode}: {error_line(output)}")
    return None


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "[ERROR]" in line or "Error" in line]
    last = (lines or output.strip().splitlines() or [""])[-1]
    return last.split("[ERROR] - ", 1)[-1].strip()


if __name__ == "__main__":
    sys.exit(main())
