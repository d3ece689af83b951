"""The whole commands scripts/benchmark.py times: (b) `python src/train.py` to its first training step against
`import torch` and a hand-written script's first step, and (c) the parallel strategies against parallel=single.
Imported by benchmark.py."""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HANDWRITTEN_FIRST_STEP = """
import torch, torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
F.cross_entropy(model(x), y).backward()
optimizer.step()
"""
# The same script with train.py's start-up measure (the collector paused during the imports): what is left between
# this and train.py is hydraloop's own start-up cost.
HANDWRITTEN_FIRST_STEP_PAUSED = (
    "import gc\ngc.disable()\nimport torch, torch._dynamo\ngc.freeze()\ngc.enable()\n" + HANDWRITTEN_FIRST_STEP
)


def run_command(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - start


def startup(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        train = [
            sys.executable,
            str(REPO / "src" / "train.py"),
            "data=synthetic",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=1",
            "trainer.limit_val_batches=1",
            "logger=none",
            "trainer.save_checkpoints=false",
            f"device={args.device}",
            f"hydra.run.dir={tmp}/run",
        ]
        commands = {
            "train.py to first step": train,
            "import torch": [sys.executable, "-c", "import torch"],
            # Every torch optimizer imports torch._dynamo (~1 s) in its constructor: a hand-written script pays it too.
            "hand-written first step": [sys.executable, "-c", HANDWRITTEN_FIRST_STEP],
            "hand-written, collector paused": [sys.executable, "-c", HANDWRITTEN_FIRST_STEP_PAUSED],
        }
        if not args.smoke:
            run_command(train)  # fills the data cache and the OS file cache
        times = {label: [] for label in commands}
        for _ in range(args.repeats):
            for label, command in commands.items():
                times[label].append(run_command(command))
    first_step, torch_import, handwritten, paused = (statistics.median(times[label]) for label in commands)
    return {
        "train_py_first_step_s": first_step,
        "import_torch_s": torch_import,
        "handwritten_first_step_s": handwritten,
        "handwritten_paused_first_step_s": paused,
        "overhead_vs_import_torch_s": first_step - torch_import,
        "overhead_vs_handwritten_s": first_step - handwritten,
        "overhead_vs_handwritten_paused_s": first_step - paused,
        "samples": times,
    }


NO_REPLICA_CHECK = "no replica check"  # in a variant's name, which names its run directory: no comma
LOADER_WORKERS = "1 loader worker each"


def ddp_scaling(args) -> list[dict]:
    """Whole commands; loop throughput from metrics.json (global samples over the time spent in fit). With the most
    ranks of `--ddp-procs`, also ddp with trainer.replica_check_every_n_steps=0, for the check's cost at its default,
    and ddp with a loader worker per rank (data.num_workers=1)."""
    common = [
        "data=synthetic",
        "data.dataset.num_train=32768",
        "data.batch_size=256",
        "model.hidden_sizes=[512,512]",
        "trainer.max_epochs=3",
        "trainer.limit_val_batches=1",
        "logger=none",
        "trainer.save_checkpoints=false",
        f"device={args.device}",
    ]
    variants = {
        "single": ["parallel=single"],
        "dataparallel": ["parallel=dataparallel"],
        **{f"ddp x{n}": ["parallel=ddp", f"parallel.nproc_per_node={n}"] for n in args.ddp_procs},
    }
    replicated = max(args.ddp_procs)
    if replicated > 1:  # the replica check at its default (each validation and checkpoint) against none
        check_off = ["parallel=ddp", f"parallel.nproc_per_node={replicated}", "trainer.replica_check_every_n_steps=0"]
        variants[f"ddp x{replicated} {NO_REPLICA_CHECK}"] = check_off
        # Loader workers under spawned ranks: a fork server per rank, started as the loaders are built (its wall time
        # against the row without workers: the servers' start; their throughput: loading in other processes).
        with_workers = ["parallel=ddp", f"parallel.nproc_per_node={replicated}", "data.num_workers=1"]
        variants[f"ddp x{replicated} {LOADER_WORKERS}"] = with_workers
    results = {label: {"wall_s": [], "samples_per_s": []} for label in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(max(1, args.repeats // 2)):
            for label, overrides in variants.items():
                run_dir = Path(tmp) / f"{label.replace(' ', '_')}_{repeat}"
                wall = run_command(
                    [sys.executable, str(REPO / "src" / "train.py"), *common, *overrides, f"hydra.run.dir={run_dir}"]
                )
                metrics = json.loads((run_dir / "metrics.json").read_text())
                results[label]["wall_s"].append(wall)
                results[label]["samples_per_s"].append(metrics["global_step"] * 256 / metrics["wall_time_s"])
    single = statistics.median(results["single"]["samples_per_s"])
    return [
        {
            "variant": label,
            "wall_s": statistics.median(r["wall_s"]),
            "samples_per_s": statistics.median(r["samples_per_s"]),
            "ratio_vs_single": statistics.median(r["samples_per_s"]) / single,
            "samples": r,
        }
        for label, r in results.items()
    ]
