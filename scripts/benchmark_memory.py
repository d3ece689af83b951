"""(f) Memory: each rank's peak memory training the GPT under single, ddp and fsdp, with and without activation
checkpointing, through a checkpoint save and a resume; and how long a checkpoint stalls training, written
synchronously against in the background (parallel.async_checkpoint).

    python scripts/benchmark_memory.py [--sizes 4x512:32x256 8x1024] [--ranks 2] [--out outputs/benchmark_memory.json]

Each figure comes from whole commands (`python src/train.py experiment=text_gpt ...`, 2 steps and a checkpoint,
then a resume to step 3 and another checkpoint), each process reporting its own peak as it exits (a sitecustomize on
PYTHONPATH): on the CPU its largest resident set (ru_maxrss), on a GPU torch.cuda.max_memory_allocated. The runtime's
own share (interpreter, torch, Hydra, the data: the same command with a GPT of one 32-wide layer) is subtracted, and
each rank's figure above it is set against single-process training's: fsdp's goal is about 1/N of it, plus one
block's parameters gathered. On the CPU every process runs with MALLOC_MMAP_THRESHOLD_=65536: by default glibc
raises its threshold for memory from the operating system as tensors are freed (up to 32 MiB) and then keeps what
smaller tensors free in its arenas, one more per thread, so that the resident set would measure its retention (this
GPT under fsdp: 1300 MiB above the runtime's against 950 with the fixed threshold; single 2200 against 1600) rather
than the memory a strategy holds. The stall is the loop's wall time with a checkpoint every 2 steps, less the same run's
without, per checkpoint. Printed as a table and written as JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

REPORT_PEAK = """
import atexit, json, os, resource, sys

def _report_peak():
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "rss_mib": rss_mib}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    with open(os.path.join(os.environ["HYDRALOOP_PEAK_DIR"], f"{os.getpid()}.json"), "w") as file:
        json.dump(peak, file)

if os.environ.get("HYDRALOOP_PEAK_DIR"):
    atexit.register(_report_peak)
"""
BASE = (
    "experiment=text_gpt",
    "model.dropout=0.0",
    "trainer.limit_val_batches=2",
    "logger=none",
    "trainer.log_every_n_steps=1",
    "scheduler.warmup_steps=0",
)
# One GPT whose activations dominate its memory, one whose weights and optimizer state do.
SIZES = ["4x512:32x256", "8x1024"]
STRATEGIES = {"single": ("parallel=single",), "ddp": ("parallel=ddp",), "fsdp": ("parallel=fsdp",)}


def gpt(size: str) -> tuple[str, ...]:
    """LAYERSxWIDTH[:BATCHxBLOCK] (default batch 8 of 64 tokens) as overrides."""
    model, _, batch = size.partition(":")
    layers, width = (int(part) for part in model.split("x"))
    rows, block = (int(part) for part in (batch or "8x64").split("x"))
    model_overrides = (f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={max(1, width // 64)}")
    return *model_overrides, f"data.batch_size={rows}", f"data.block_size={block}"


def peaks(overrides: list[str], run_dir: Path, env: dict[str, str]) -> dict[str, float]:
    """Runs `python src/train.py OVERRIDES` into `run_dir`; each rank's peak (rank "0" for single), in MiB."""
    with tempfile.TemporaryDirectory() as reports:
        command = [sys.executable, str(REPO / "src" / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
        done = subprocess.run(command, cwd=REPO, env={**env, "HYDRALOOP_PEAK_DIR": reports}, capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(overrides)} failed:\n{done.stdout.decode()[-3000:]}{done.stderr.decode()}")
        found = [json.loads(path.read_text()) for path in Path(reports).glob("*.json")]
    ranked = [peak for peak in found if peak["rank"] is not None] or found  # single: its process (the largest)
    figure = "cuda_mib" if any("cuda_mib" in peak for peak in ranked) else "rss_mib"
    by_rank: dict[str, float] = {}
    for peak in ranked:
        rank = str(peak["rank"] or 0)
        by_rank[rank] = max(by_rank.get(rank, 0.0), round(peak.get(figure, 0.0), 1))
    return by_rank


def wall_time(overrides: list[str], run_dir: Path, env: dict[str, str]) -> float:
    command = [sys.executable, str(REPO / "src" / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return json.loads((run_dir / "metrics.json").read_text())["wall_time_s"]


def measure(args) -> dict:
    sitecustomize = Path(tempfile.mkdtemp()) / "sitecustomize.py"
    sitecustomize.write_text(REPORT_PEAK)
    path = os.pathsep.join(filter(None, [str(sitecustomize.parent), str(REPO)]))
    env = {**os.environ, "PYTHONPATH": path, "MALLOC_MMAP_THRESHOLD_": "65536"}
    # Spawned, as on GPUs: a rank forked from the launcher (the CPU's default) would neither start from a fresh
    # process's memory nor run the sitecustomize's exit handler, which is the launcher's.
    ranks = (f"parallel.nproc_per_node={args.ranks}", "parallel.start_method=spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            chosen = STRATEGIES[strategy]
            parallel = (*chosen, *ranks) if strategy != "single" else chosen
            baseline = peaks(
                [*BASE, *parallel, *gpt("1x32"), "trainer.max_steps=2"], Path(tmp) / f"base-{strategy}", env
            )
            for size in args.sizes:
                for recompute in args.recompute:
                    run_dir = Path(tmp) / f"{strategy}-{size}-{recompute}"
                    common = [
                        *BASE,
                        *parallel,
                        *gpt(size),
                        f"trainer.activation_checkpointing={str(recompute).lower()}",
                    ]
                    trained = peaks([*common, "trainer.max_steps=2"], run_dir, env)
                    resumed = peaks([*common, "trainer.max_steps=3"], run_dir, env)
                    rows.append(
                        {
                            "strategy": strategy,
                            "gpt": size,
                            "activation_checkpointing": recompute,
                            "baseline_mib": baseline,
                            "train_and_save_mib": trained,
                            "resume_and_save_mib": resumed,
                            "above_baseline_mib": {
                                rank: round(max(trained[rank], resumed[rank]) - baseline.get(rank, 0.0), 1)
                                for rank in trained
                            },
                        }
                    )
                    print(row_line(rows[-1]), flush=True)
        stalls = checkpoint_stalls(args, env, Path(tmp), ranks) if args.repeats else []
    singles = {(r["gpt"], r["activation_checkpointing"]): r for r in rows if r["strategy"] == "single"}
    for row in rows:
        single = singles.get((row["gpt"], row["activation_checkpointing"]))
        highest = max(row["above_baseline_mib"].values())
        row["vs_single"] = round(highest / single["above_baseline_mib"]["0"], 3) if single else None
    return {"ranks": args.ranks, "rows": rows, "checkpoint_stall": stalls}


def checkpoint_stalls(args, env: dict[str, str], tmp: Path, ranks: tuple[str, ...]) -> list[dict]:
    """fsdp, the largest GPT: the loop's wall time per checkpoint, written synchronously and in the background."""
    common = [*BASE, "parallel=fsdp", *ranks, *gpt(args.sizes[-1]), "trainer.max_steps=8"]
    results = []
    for written in ("synchronously", "in the background"):
        switch = [f"parallel.async_checkpoint={str(written != 'synchronously').lower()}"]
        extra = []
        for repeat in range(args.repeats):
            with_checkpoints = wall_time(
                [*common, *switch, "trainer.ckpt_every_n_steps=2"], tmp / f"c{written}{repeat}", env
            )
            without = wall_time([*common, *switch], tmp / f"n{written}{repeat}", env)
            extra.append((with_checkpoints - without) / 3)  # steps 2, 4 and 6; step 8's is in both
        results.append(
            {"written": written, "stall_s_per_checkpoint": round(statistics.median(extra), 3), "samples": extra}
        )
        print(
            f"  checkpoint every 2 steps, written {written}: {results[-1]['stall_s_per_checkpoint']:.3f} s each",
            flush=True,
        )
    return results


def row_line(row: dict) -> str:
    recompute = "recompute" if row["activation_checkpointing"] else "keep"
    ranks = ", ".join(f"rank {rank} {mib:.0f}" for rank, mib in sorted(row["above_baseline_mib"].items()))
    return f"  {row['strategy']:6} GPT {row['gpt']:8} {recompute:9} MiB above the runtime's: {ranks}"


def print_report(report: dict) -> None:
    for row in report["rows"]:
        print(f"{row_line(row)}  (x{row['vs_single']} single's)" if row["vs_single"] else row_line(row))
    for stall in report["checkpoint_stall"]:
        print(f"  checkpoint every 2 steps, written {stall['written']}: {stall['stall_s_per_checkpoint']:.3f} s each")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=SIZES,
        help="GPTs as LAYERSxWIDTH[:BATCHxBLOCK] (default 8x64): one whose activations dominate, one its weights",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=3, help="of the stall measurement (0: none)")
    parser.add_argument(
        "--activations",
        nargs="+",
        default=["keep", "recompute"],
        choices=["keep", "recompute"],
        help="kept for the backward pass, or recomputed (trainer.activation_checkpointing)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark_memory.json")
    args = parser.parse_args()
    args.recompute = [choice == "recompute" for choice in args.activations]
    print("(f) memory: each rank's peak above the runtime's own, through a save and a resume")
    report = measure(args)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
