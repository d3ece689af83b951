"""The GPU check's steps (scripts/gpu_check.sh starts it with the right interpreter): one command for a GPU machine
lent for a few minutes, offline, with a CUDA PyTorch already installed.

1. machine: torch, CUDA, the GPUs;
2. tests: tests/test_cuda.py (the CUDA sync-count test among them) and tests/test_device_paths.py;
3. benchmark: scripts/benchmark.py in fp32 (loop, start-up, strategies) and bf16 (loop);
4. runs: whole MNIST-1D CNN trainings: single in fp32 and bf16 with compile off and on, dataparallel, ddp and fsdp
   with as many ranks as there are GPUs (at most 2); and experiment=text_gpt in bf16, compiled: tokens/s and MFU;
5. memory: scripts/benchmark_memory.py's table (each rank's max_memory_allocated through a save and a resume) under
   single, ddp and fsdp with as many ranks as there are GPUs (at most 2; on one GPU, fsdp with one rank is the
   degenerate case, reported as such);
6. attention: scripts/benchmark_attention.py, a GPT-2 with attention dropout at 2048 tokens, keyed (a block of
   queries at a time) against torch's dropout in the fused kernel: time per step, peak memory, and whether the
   (batch, heads, T, T) weights are saved for the backward pass.

Every step gets what is left of `--budget-s`; one that fails or runs out of time does not stop the others. Writes
OUT/gpu_check.json (everything) beside OUT/gpu_check.log (all the output), prints a short table, and exits 1 when
something failed. `--device cpu` runs every step on the CPU: a dry run of the script itself.
"""

import argparse
import csv
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_cuda.py", "tests/test_device_paths.py"]
LOOP_WORKLOADS = ["synthetic MLP", "MNIST-1D CNN", "GPT", "GPT, dropout"]  # scripts/benchmark.py's (a)


class Steps:
    """Runs commands within one time budget, logging their output and recording how each ended."""

    def __init__(self, budget_s: float, log, slowdown: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.log = log
        self.slowdown = slowdown  # each step's time limit is for a GPU; a CPU dry run gets this many times more
        self.record: list[dict] = []

    def run(self, name: str, command: list[str], limit_s: float, env: dict | None = None) -> tuple[str, str]:
        """(status, output): status is ok, failed (exit N), timed out, or skipped (no time left)."""
        left, limit_s = self.deadline - time.monotonic(), limit_s * self.slowdown
        if left < 5:
            self.record.append({"step": name, "status": "skipped: no time left", "seconds": 0.0})
            return "skipped", ""
        start = time.monotonic()
        self.log(f"\n== {name}: {' '.join(command)}")
        try:
            proc = subprocess.run(
                command, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(limit_s, left)
            )
            output, status = (
                proc.stdout + proc.stderr,
                "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
            )
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
            status = f"timed out after {min(limit_s, left):.0f} s"
        self.log(output.rstrip())
        seconds = time.monotonic() - start
        self.record.append({"step": name, "status": status, "seconds": round(seconds, 1)})
        return status, output

    @property
    def failed(self) -> list[str]:
        return [
            f"{r['step']}: {r['status']}" for r in self.record if r["status"] != "ok" and "skipped" not in r["status"]
        ]


def machine(device: str) -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def test_counts(output: str) -> dict:
    """pytest's closing line, e.g. '12 passed, 2 skipped in 40.1s' -> {'passed': 12, 'skipped': 2}."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)}


def run_variants(device: str, epochs: int) -> list[tuple[dict, list[str]]]:
    """Step 4's MNIST-1D CNN runs: (what each varies, its overrides of src/train.py). tests/test_gpu_check.py passes
    each through the launcher's checks, so a change to a recipe that would break this step fails CI, not the day a
    GPU is lent."""
    ranks = min(torch.cuda.device_count(), 2) if device == "cuda" else 2
    variants = [("single", p, c) for p in ("32", "bf16") for c in ("false", "true")]
    variants += [(strategy, p, "false") for strategy in ("dataparallel", "ddp") for p in ("32", "bf16")]
    variants += [("fsdp", "32", "false")]
    runs = []
    for strategy, precision, compile_ in variants:
        overrides = [f"parallel={strategy}", f"device={device}", f"trainer.precision={precision}"]
        overrides += [f"trainer.compile={compile_}", "experiment=mnist1d_cnn", f"trainer.max_epochs={epochs}"]
        overrides += ["logger=none", "trainer.save_checkpoints=false"]
        if strategy in ("ddp", "fsdp"):
            overrides.append(f"parallel.nproc_per_node={ranks}")
        runs.append(({"strategy": strategy, "precision": precision, "compile": compile_}, overrides))
    return runs


def gpt_overrides(device: str) -> list[str]:
    """Step 4's compiled bf16 GPT, whose tokens/s give the MFU. The CPU dry run trains 20 steps, so its warm-up is
    shortened to fit them (the recipe's 40 steps are longer than the run, which the launcher refuses)."""
    overrides = ["experiment=text_gpt", f"device={device}", "trainer.precision=bf16", "trainer.compile=true"]
    overrides += ["trainer.max_steps=20", "scheduler.warmup_steps=5"] if device == "cpu" else ["trainer.max_steps=300"]
    overrides += ["logger=csv", "trainer.val_every_n_steps=null", "trainer.log_every_n_steps=10"]
    return [*overrides, "trainer.save_checkpoints=false"]


def training_runs(args, steps: Steps, out: Path, env: dict) -> list[dict]:
    rows = []
    for variant, overrides in run_variants(args.device, args.epochs):
        name = "{strategy}-{precision}-compile_{compile}".format(**variant)
        run_dir = out / "runs" / name
        command = [sys.executable, "src/train.py", *overrides, f"hydra.run.dir={run_dir}"]
        limit_s = 120 if variant["compile"] == "true" else 45
        status, _ = steps.run(f"run {name}", command, limit_s=limit_s, env=env)
        rows.append({**variant, "status": status})
        metrics_file = run_dir / "metrics.json"
        if status == "ok" and metrics_file.exists():
            metrics = json.loads(metrics_file.read_text())
            # The last epoch's logging intervals: compilation and warm-up are over by then.
            rates = [
                float(m.group(1))
                for line in (run_dir / "train.log").read_text().splitlines()
                if f"epoch {args.epochs} step" in line and (m := re.search(r"\| ([\d.]+) samples/s", line))
            ]
            rows[-1].update(
                samples_per_s=statistics.median(rates) if rates else None,
                wall_time_s=metrics["wall_time_s"],
                val_acc=metrics["val/acc"],
                world_size=metrics["world_size"],
            )
    return rows


def gpt_run(args, steps: Steps, out: Path, env: dict) -> dict:
    """experiment=text_gpt in bf16, compiled: tokens/s and MFU (against hydraloop.perf's table of GPU peaks) over
    the last logging intervals, after compilation."""
    run_dir = out / "runs" / "text_gpt-bf16-compile"
    command = [sys.executable, "src/train.py", *gpt_overrides(args.device)]
    status, _ = steps.run("run text_gpt bf16 compiled", [*command, f"hydra.run.dir={run_dir}"], limit_s=150, env=env)
    row: dict = {"status": status}
    logged = []
    if status == "ok":
        logged = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("perf/tokens_per_sec")][-3:]
    if logged:
        row["tokens_per_s"] = statistics.median(float(r["perf/tokens_per_sec"]) for r in logged)
        mfu = [float(r["perf/mfu"]) for r in logged if r.get("perf/mfu")]
        row["mfu"] = statistics.median(mfu) if mfu else None
        row["val_loss"] = json.loads((run_dir / "metrics.json").read_text())["val/loss"]
    return row


def memory_table(args, steps: Steps, out: Path, env: dict) -> dict:
    ranks = "2" if args.device == "cpu" or torch.cuda.device_count() > 1 else "1"
    json_file = out / "benchmark_memory.json"
    command = [
        sys.executable,
        "scripts/benchmark_memory.py",
        "--ranks",
        ranks,
        "--repeats",
        "1",
        "--out",
        str(json_file),
    ]
    status, _ = steps.run("memory", command, limit_s=150, env=env)
    if status != "ok":
        return {}
    return {**json.loads(json_file.read_text()), "degenerate": ranks == "1"}


def long_attention(args, steps: Steps, out: Path, env: dict) -> dict:
    json_file = out / "benchmark_attention.json"
    size = ["--length", "512", "--batch", "2"] if args.device == "cpu" else ["--length", "2048", "--batch", "4"]
    command = [sys.executable, "scripts/benchmark_attention.py", "--device", args.device, *size]
    command += ["--out", str(json_file)]
    status, _ = steps.run("attention", command, limit_s=90, env=env)
    return json.loads(json_file.read_text()) if status == "ok" else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=REPO / "outputs" / "gpu_check")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--budget-s", type=float, help="all steps together; default 340 s (GPU), 1800 s (CPU)")
    args = parser.parse_args()
    dry_run = args.device == "cpu"
    args.epochs = 1 if dry_run else 3
    args.budget_s = args.budget_s or (1800 if dry_run else 340)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu_check: torch {torch.__version__} sees no GPU; --device cpu runs the steps on the CPU")
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    log_file = (out / "gpu_check.log").open("w")

    def log(text: str) -> None:
        print(text, flush=True)
        print(text, file=log_file, flush=True)

    env = {**os.environ, "HYDRALOOP_TEST_DEVICE": args.device, "PYTHONUNBUFFERED": "1"}
    report: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(args.device)}
    log(json.dumps(report["machine"]))
    steps = Steps(args.budget_s, log, slowdown=5 if dry_run else 1)

    _, output = steps.run("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], 180, env)
    report["tests"] = test_counts(output)

    ddp_procs = ["1", "2"] if dry_run or torch.cuda.device_count() > 1 else ["1"]  # never 2 ranks on one GPU
    quick = ["--repeats", "2", "--loop-processes", "1"] if dry_run else ["--repeats", "3", "--loop-processes", "2"]
    # The image-folder workloads need torchvision, which GPU images carry but the wheels folder cannot stand in for.
    vision = importlib.util.find_spec("torchvision") is not None
    workloads = [*LOOP_WORKLOADS, *(["image folder CNN"] if vision else [])]
    report["benchmark"] = {"torchvision": vision}
    # Memory is a step of its own (5), within its own time.
    for precision, skip in (
        # The peers' sections (Lightning's, transformers' Trainer's) are not GPU figures: never in the check's budget.
        ("32", ["memory", "lightning", "hf_trainer"] + ([] if vision else ["images"])),
        ("bf16", ["startup", "ddp", "images", "memory", "lightning", "hf_trainer"]),
    ):
        json_file = out / f"benchmark_{precision}.json"
        command = [sys.executable, "scripts/benchmark.py", "--device", args.device, "--precision", precision, *quick]
        command += ["--ddp-procs", *ddp_procs, "--workloads", *workloads, "--out", str(json_file)]
        command += ["--skip", *skip] if skip else []
        status, _ = steps.run(f"benchmark {precision}", command, limit_s=150, env=env)
        if status == "ok":
            report["benchmark"][precision] = json.loads(json_file.read_text())

    report["runs"] = training_runs(args, steps, out, env)
    report["gpt"] = gpt_run(args, steps, out, env)
    report["memory"] = memory_table(args, steps, out, env)
    report["attention"] = long_attention(args, steps, out, env)
    report["steps"], report["failed"] = steps.record, steps.failed
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    log(summary(report))
    log_file.close()
    sys.exit(1 if steps.failed else 0)


def summary(report: dict) -> str:
    lines = ["", "== summary", f"tests: {report['tests']}"]
    for precision, bench in report["benchmark"].items():
        if not isinstance(bench, dict):
            continue
        ratios = ", ".join(f"{row['workload']} {row['ratio']:.3f}" for row in bench.get("loop", []))
        lines.append(f"benchmark {precision}: loop vs hand-written {ratios}")
        if "startup" in bench:
            lines.append(f"  start-up to first step {bench['startup']['train_py_first_step_s']:.2f} s")
        for row in bench.get("ddp", []):
            lines.append(f"  {row['variant']:<14}{row['samples_per_s']:>10.0f} samples/s, {row['ratio_vs_single']:.3f}")
    lines.append(f"{'run':<34}{'samples/s':>10}{'wall s':>8}{'val/acc':>8}  status")
    for row in report["runs"]:
        name = f"{row['strategy']} {row['precision']} compile={row['compile']}"
        rate, wall, acc = row.get("samples_per_s"), row.get("wall_time_s"), row.get("val_acc")
        figures = f"{rate or 0:>10.0f}{wall:>8.1f}{acc:>8.4f}" if wall is not None else f"{'-':>10}{'-':>8}{'-':>8}"
        lines.append(f"{name:<34}{figures}  {row['status']}")
    gpt = report["gpt"]
    if "tokens_per_s" in gpt:
        mfu = "-" if gpt["mfu"] is None else f"{gpt['mfu']:.1%}"
        lines.append(
            f"text_gpt bf16 compiled: {gpt['tokens_per_s']:.0f} tokens/s, MFU {mfu}, val/loss {gpt['val_loss']:.3f}"
        )
    memory = report.get("memory") or {}
    if memory:
        one = " (one GPU: fsdp with one rank, the degenerate case)" if memory["degenerate"] else ""
        lines.append(f"memory, MiB above the runtime's, each rank's largest{one}:")
        for row in memory["rows"]:
            recompute = "recompute" if row["activation_checkpointing"] else "keep"
            vs = f", x{row['vs_single']} single's" if row["vs_single"] else ""
            figures = ", ".join(f"{mib:.0f}" for _, mib in sorted(row["above_baseline_mib"].items()))
            lines.append(f"  {row['strategy']:6} GPT {row['gpt']:8} {recompute:9} {figures}{vs}")
        for stall in memory["checkpoint_stall"]:
            lines.append(f"  checkpoint written {stall['written']}: {stall['stall_s_per_checkpoint']:.3f} s stall")
    attention = report.get("attention") or {}
    if attention:
        lines.append(f"GPT-2, attention dropout, {attention['batch']} x {attention['length']} tokens:")
        for row in attention["rows"]:
            peak = "-" if row["peak_mib_above_model"] is None else f"{row['peak_mib_above_model']:.0f} MiB"
            saves = "saves" if row["saves_attention_weights"] else "saves no"
            figures = f"{row['ms_per_step']:>8.1f} ms/step, peak {peak}, {saves} T x T weights"
            lines.append(f"  {row['dropout']:<34}{figures}")
    skipped = [r["step"] for r in report["steps"] if "skipped" in r["status"]]
    lines.append(f"skipped for lack of time: {', '.join(skipped)}" if skipped else "every step ran")
    lines.append(f"FAILED: {'; '.join(report['failed'])}" if report["failed"] else "nothing failed")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
