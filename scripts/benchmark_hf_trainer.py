"""(h) transformers' Trainer as a peer (needs the `hf` extra and accelerate, in the `bench` extra): hydraloop's loop
against `Trainer.train()` on the same model, data, batch, optimizer and schedule, in one invocation.

    python scripts/benchmark_hf_trainer.py [--repeats 5] [--epochs 3] [--workloads bert gpt2] [--rows 4000]
                                           [--device auto] [--precision 32] [--out outputs/benchmark_hf_trainer.json]

The data, made here once with no download: `--rows` lines of the bundled plays, evenly spaced, labelled with their
play (scripts/make_play_lines.py), as a csv, and a byte-level BPE of 300 tokens trained on them, with a <pad> token;
10% held out. Two workloads, each model built from its config with fresh weights, 2 layers of 64 with dropout 0.1
everywhere (scripts/benchmark_hf_trainer_run.py's MODELS): `bert`, a BERT classifier of the lines' plays
(data=hf); `gpt2`, a GPT-2 language model of the same lines (data=hf_lm, each line one sample, the loss over its
tokens). Recipe, both sides: batch 32 padded to its longest line, the last incomplete one dropped, AdamW at 1e-3
with weight decay 0.01 (none on biases and norm weights), a constant learning rate, gradients clipped to norm 1
(Trainer's default), seed 0. hydraloop runs it as a user would:

    python src/train.py data=hf data.dataset.path=CSV data.dataset.tokenizer=TOKENIZER data.dataset.pad_token='<pad>'
        data.num_classes=3 data.block_size=64 model=hf model.auto_class=AutoModelForSequenceClassification
        model.model_type=bert +model.config.num_hidden_layers=2 ... optimizer.lr=0.001 optimizer.no_weight_decay=true
        trainer.grad_clip_norm=1.0 trainer.max_epochs=3

and Trainer as its users write it (benchmark_hf_trainer_run.py). Each in two modes:
- as shipped: hydraloop with nothing turned off (keyed dropout, AdamW as torch picks it, and in the whole command a
  validation, TensorBoard logs and checkpoints after each epoch); Trainer with its defaults (its fused AdamW, a
  progress bar, logging every 500 steps, no evaluation) but for reporting and saving: report_to="none" and
  save_strategy="no" (its default would write a checkpoint at the last step).
- equal work: the same computation on both sides: hydraloop with torch's dropout (model.keyed_dropout=false, the
  model then runs exactly as transformers ships it) and Trainer's fused AdamW (optimizer.fused=true); Trainer without
  its progress bar, logging and NaN/inf filter of the logged loss (a host sync per step). In the whole command both
  evaluate after each epoch (Trainer: eval_strategy="epoch" on the held-out rows) and neither writes logs or
  checkpoints (hydraloop: logger=none trainer.save_checkpoints=false).

Measured: (1) samples per second of the training loop, in this process: hydraloop's Trainer.train_epoch (its loop
built as src/train.py builds it, benchmark_loops.hydraloop_epoch) against a Trainer.train() of one more epoch than
timed, the first left out, timed from the next epoch's start to the end of training; the four contenders in turn, the
ratio (hydraloop over Trainer, > 1: hydraloop faster) the median of each repeat's. (2) The whole command, start-up to
exit, `--epochs` epochs: `python src/train.py ...` against `python scripts/benchmark_hf_trainer_run.py ...`, once
each first to fill the data caches, then interleaved (A B A B); the ratio Trainer's time over hydraloop's. Medians.

Past 300 lines because it is one comparison: the shared data, hydraloop's command, the runs in turn and the table
would each be half an idea alone; its Trainer side is benchmark_hf_trainer_run.py.
"""

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

from benchmark_loops import chosen_device, compose_config, hydraloop_epoch, report_header, timed  # noqa: E402
from make_image_folder import DEFAULT_ROOT  # noqa: E402
from make_play_lines import play_lines  # noqa: E402

RUN = REPO / "scripts" / "benchmark_hf_trainer_run.py"
DATA_DIR = DEFAULT_ROOT.with_name("hf_trainer_plays")  # beside benchmark.py's other data, in hydraloop's cache
WORKLOADS = {"bert": "BERT classifier", "gpt2": "GPT-2 LM"}
MODES = ("as shipped", "equal work")
EPOCHS, ROWS = 3, 4000  # the fine-tune: 3 epochs of a 4000-row csv
NEEDED = {"transformers": "hf", "datasets": "hf", "accelerate": "bench"}  # module: the extra that installs it


def missing_note() -> str | None:
    """The line that says why (h) is skipped, or None when Trainer can run."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    extras = ",".join(sorted({NEEDED[name] for name in missing}))
    return f"{', '.join(missing)} not installed (pip install 'hydraloop[{extras}]')"


def write_data(rows: int) -> tuple[Path, Path]:
    """The csv of `rows` labelled lines and the tokenizer trained on them, in DATA_DIR (made once; each written
    under a temporary name and renamed, so complete whenever it exists)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    csv_path, tokenizer_path = DATA_DIR / f"play_lines_{rows}.csv", DATA_DIR / f"tokenizer_{rows}.json"
    lines = play_lines()
    if rows > len(lines):
        raise SystemExit(f"--rows {rows}: the plays have {len(lines)} lines")
    chosen = [lines[i * len(lines) // rows] for i in range(rows)]  # evenly spaced: all three plays
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    if not csv_path.exists():
        import csv

        handle, tmp = tempfile.mkstemp(prefix=f".{csv_path.name}.", dir=DATA_DIR)
        with os.fdopen(handle, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["text", "label"])
            writer.writerows(chosen)
        os.replace(tmp, csv_path)
    if not tokenizer_path.exists():
        from benchmark_hf_trainer_run import PAD

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=[PAD], initial_alphabet=alphabet)
        tokenizer.train_from_iterator((text for text, _ in chosen), bpe)
        handle, tmp = tempfile.mkstemp(prefix=f".{tokenizer_path.name}.", dir=DATA_DIR)
        os.close(handle)
        tokenizer.save(tmp)
        os.replace(tmp, tokenizer_path)
    return csv_path, tokenizer_path


def hydraloop_overrides(workload: str, csv: Path, tokenizer: Path, epochs: int, equal_work: bool) -> list[str]:
    """The command line a hydraloop user gives for the workload (equal_work: torch's dropout, Trainer's fused AdamW)."""
    from benchmark_hf_trainer_run import BATCH, BLOCK, CLIP, LR, MODELS, PAD, SEED, VAL_FRACTION, WEIGHT_DECAY

    auto_class, model_type, sizes = MODELS[workload]
    data = ["data=hf", "data.num_classes=3"] if workload == "bert" else ["data=hf_lm", "task=language_model"]
    overrides = [
        *data,
        *[f"data.dataset.path={csv}", f"data.dataset.tokenizer={tokenizer}", f"data.dataset.pad_token='{PAD}'"],
        *[f"data.block_size={BLOCK}", f"data.batch_size={BATCH}", f"data.dataset.val_fraction={VAL_FRACTION}"],
        *["model=hf", f"model.auto_class={auto_class}", f"model.model_type={model_type}"],
        *(f"+model.config.{key}={value}" for key, value in sizes.items()),
        *[f"optimizer.lr={LR}", f"optimizer.weight_decay={WEIGHT_DECAY}", "optimizer.no_weight_decay=true"],
        *[f"trainer.grad_clip_norm={CLIP}", f"trainer.max_epochs={epochs}", f"seed={SEED}"],
    ]
    return [*overrides, "model.keyed_dropout=false", "optimizer.fused=true"] if equal_work else overrides


def trainer_epoch_rate(
    workload: str, data: tuple[Path, Path], device: torch.device, precision: str, equal_work: bool, epochs: int
) -> tuple[float, int]:
    """(samples per second, the model's parameters) of one Trainer.train() over `epochs` + 1 epochs, the first
    (warm-up) left out: from the second epoch's start to the end of training, so per-epoch extras count."""
    from benchmark_hf_trainer_run import BATCH, build_trainer
    from transformers import TrainerCallback

    class EpochTimes(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.timed_steps = 0

        def on_epoch_begin(self, args, state, control, **kwargs) -> None:
            self.starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.timed_steps += len(self.starts) > 1

        def on_train_end(self, args, state, control, **kwargs) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.end = time.perf_counter()

    times = EpochTimes()
    # The progress bar and logs (as shipped) are written, to memory rather than the terminal.
    with (
        tempfile.TemporaryDirectory() as tmp,
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        trainer = build_trainer(
            workload,
            str(data[0]),
            str(data[1]),
            epochs + 1,
            equal_work=equal_work,
            evaluate=False,
            device="cpu" if device.type == "cpu" else "cuda",
            precision=precision,
            output_dir=tmp,
            callbacks=[times],
        )
        trainer.train()
    parameters = sum(parameter.numel() for parameter in trainer.model.parameters())
    return times.timed_steps * BATCH / (times.end - times.starts[1]), parameters


def loop_throughput(args, device: torch.device, data: tuple[Path, Path]) -> list[dict]:
    """(1): per workload and mode, hydraloop's loop against Trainer.train(), samples taken in turn."""
    from hydra.utils import instantiate

    rows = []
    for workload in args.workloads:
        configs = {
            mode: compose_config(
                [*hydraloop_overrides(workload, *data, 1, mode == "equal work"), f"trainer.precision={args.precision}"]
            )
            for mode in MODES
        }
        hydraloop_parameters = sum(p.numel() for p in instantiate(configs["equal work"].model).parameters())
        loops = {mode: hydraloop_epoch(cfg, device) for mode, cfg in configs.items()}
        for loop in loops.values():
            loop()  # warm-up
        start = time.perf_counter()
        loops["as shipped"]()
        epochs = max(1, math.ceil(1.0 / (time.perf_counter() - start)))  # samples of about a second or more
        samples = {f"{side}, {mode}": [] for mode in MODES for side in ("hydraloop", "Trainer")}
        for _ in range(args.repeats):
            for mode in MODES:
                samples[f"hydraloop, {mode}"].append(timed(loops[mode], device, epochs))
                rate, trainer_parameters = trainer_epoch_rate(
                    workload, data, device, args.precision, mode == "equal work", epochs
                )
                samples[f"Trainer, {mode}"].append(rate)
        if trainer_parameters != hydraloop_parameters:
            raise SystemExit(
                f"{workload}: hydraloop's model has {hydraloop_parameters} parameters, Trainer's "
                f"{trainer_parameters}: not the same model"
            )
        for mode in MODES:
            ours, theirs = samples[f"hydraloop, {mode}"], samples[f"Trainer, {mode}"]
            rows.append(
                {
                    "workload": WORKLOADS[workload],
                    "mode": mode,
                    "parameters": hydraloop_parameters,
                    "epochs_per_sample": epochs,
                    "hydraloop_samples_per_s": statistics.median(ours),
                    "trainer_samples_per_s": statistics.median(theirs),
                    "ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
                    "samples": {"hydraloop": ours, "Trainer": theirs},
                }
            )
    return rows


def command_runs(args, data: tuple[Path, Path]) -> list[dict]:
    """(2): per workload and mode, `python src/train.py ...` against the Trainer script, start-up to exit."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            commands = {}
            for mode in MODES:
                equal = mode == "equal work"
                hydraloop = [sys.executable, str(REPO / "src" / "train.py")]
                hydraloop += hydraloop_overrides(workload, *data, args.epochs, equal)
                hydraloop += [f"device={args.device}", f"trainer.precision={args.precision}"]
                hydraloop += ["logger=none", "trainer.save_checkpoints=false"] if equal else []
                trainer = [sys.executable, str(RUN), workload, *map(str, data), "--epochs", str(args.epochs)]
                trainer += ["--device", args.device, "--precision", args.precision]
                trainer += ["--equal-work", "--evaluate"] if equal else []
                commands[f"hydraloop, {mode}"], commands[f"Trainer, {mode}"] = hydraloop, trainer
            times: dict[str, list[float]] = {label: [] for label in commands}
            results: dict[str, float | None] = {}
            for repeat in range(-1, args.repeats):  # -1: the untimed first runs, which fill the data caches
                for label, command in commands.items():
                    if label.startswith("hydraloop"):  # a run directory of its own, none resumed; no comma in it
                        run_dir = f"{tmp}/{workload}_{label.split(', ')[1].replace(' ', '_')}_{repeat}"
                        command = [*command, f"hydra.run.dir={run_dir}"]
                    start = time.perf_counter()
                    done = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
                    if repeat >= 0:
                        times[label].append(time.perf_counter() - start)
                    results[label] = result_of(
                        workload, done.stdout, run_dir if label.startswith("hydraloop") else None
                    )
            for mode in MODES:
                ours, theirs = times[f"hydraloop, {mode}"], times[f"Trainer, {mode}"]
                rows.append(
                    {
                        "workload": WORKLOADS[workload],
                        "mode": mode,
                        "hydraloop_s": statistics.median(ours),
                        "trainer_s": statistics.median(theirs),
                        "ratio": statistics.median(b / a for a, b in zip(ours, theirs)),
                        "samples": {"hydraloop": ours, "Trainer": theirs},
                        "result": RESULTS[workload][0],
                        "hydraloop_result": results[f"hydraloop, {mode}"],
                        "trainer_result": results[f"Trainer, {mode}"],
                    }
                )
    return rows


# What each workload's whole command is scored by: hydraloop's metric (metrics.json) and Trainer's (its last
# evaluation, printed by benchmark_hf_trainer_run.py), both on the same held-out rows after the last epoch.
RESULTS = {"bert": ("accuracy", "val/acc", "eval_accuracy"), "gpt2": ("loss", "val/loss", "eval_loss")}


def result_of(workload: str, stdout: str, run_dir: str | None) -> float | None:
    """The command's result after its last epoch: from a hydraloop run directory's metrics.json, or the Trainer
    script's EVALUATION line (None where Trainer did not evaluate: as shipped)."""
    _, ours, theirs = RESULTS[workload]
    if run_dir is not None:
        return json.loads((Path(run_dir) / "metrics.json").read_text()).get(ours)
    line = next((line for line in stdout.splitlines() if line.startswith("EVALUATION ")), "EVALUATION {}")
    return json.loads(line.removeprefix("EVALUATION ")).get(theirs)


def measure(args, device: torch.device) -> dict:
    """(h): `args` holds repeats, epochs, workloads, rows, device (the flag) and precision."""
    import benchmark_hf_trainer_run  # noqa: F401  transformers' Trainer, imported before the freeze below

    # As src/train.py does (and benchmark.py for its own imports): what the imports made kept out of later collections,
    # so that a full collection does not land in one contender's sample.
    gc.freeze()
    data = write_data(args.rows)
    return {
        "rows": args.rows,
        "epochs": args.epochs,
        "loop": loop_throughput(args, device, data),
        "command_line": command_runs(args, data),
    }


def print_report(report: dict, repeats: int) -> None:
    print(
        f"\n(h) against transformers' Trainer, same model, data, batch, optimizer and schedule ({report['rows']} rows, "
        f"10% held out; medians of {repeats} interleaved repeats)"
    )
    print(f"{'training loop, samples/s':<36}{'hydraloop':>11}{'Trainer':>10}{'ratio':>8}")
    for row in report["loop"]:
        print(
            f"{row['workload'] + ', ' + row['mode']:<36}{row['hydraloop_samples_per_s']:>11.0f}"
            f"{row['trainer_samples_per_s']:>10.0f}{row['ratio']:>8.3f}"
        )
    print(
        f"{'whole command, ' + str(report['epochs']) + ' epochs, s':<36}{'hydraloop':>11}{'Trainer':>10}{'ratio':>8}"
        f"  results (hydraloop, Trainer)"
    )
    for row in report["command_line"]:
        scores = ", ".join(
            "-" if row[key] is None else f"{row[key]:.4f}" for key in ("hydraloop_result", "trainer_result")
        )
        print(
            f"{row['workload'] + ', ' + row['mode']:<36}{row['hydraloop_s']:>11.2f}{row['trainer_s']:>10.2f}"
            f"{row['ratio']:>8.3f}  {row['result']}: {scores}"
        )
    print("ratio > 1: hydraloop faster (samples/s hydraloop over Trainer; seconds Trainer over hydraloop)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="the whole commands' epochs")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rows", type=int, default=ROWS, help="labelled lines in the csv (10%% held out)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark_hf_trainer.json")
    args = parser.parse_args()
    for flag, value in (("--repeats", args.repeats), ("--epochs", args.epochs), ("--rows", args.rows)):
        if value < 1:
            parser.error(f"{flag} {value}: must be at least 1")
    note = missing_note()
    if note:
        print(f"(h) transformers' Trainer: skipped, {note}")
        return
    from hydraloop.config import register_configs

    register_configs()
    device = chosen_device(args.device)
    report = {
        **report_header(device, args.precision),
        "hf_trainer": measure(args, device),
    }
    print_report(report["hf_trainer"], args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
