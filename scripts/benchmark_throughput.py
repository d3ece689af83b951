"""(a) and (d) of scripts/benchmark.py, timed in Python rather than as whole commands: (a) loop throughput, hydraloop's
Trainer.train_epoch against a hand-written loop, samples interleaved, in several fresh processes; (d) images per
second through hydraloop's training loader. Imported by benchmark.py."""

import gc
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmark_loops import (
    DICT_BATCHES,
    IMAGE_FOLDER,
    PER_SAMPLE_TAIL,
    SMOKE_BATCHES,
    WORKLOADS,
    compose_config,
    handwritten_epoch,
    hydraloop_epoch,
    loading_epochs,
    smoke_overrides,
    timed,
)
from hydra.utils import instantiate

from hydraloop.data.loaders import build_loaders

BENCHMARK = str(Path(__file__).resolve().parent / "benchmark.py")  # (a) runs it again, in processes of their own


def loop_throughput(args, device: torch.device) -> list[dict]:
    rows = []
    for name in args.workloads:
        cfg = compose_config([*WORKLOADS[name], f"trainer.precision={args.precision}", *smoke_overrides(args)])
        dicts = name in DICT_BATCHES
        contenders = {
            "hydraloop": hydraloop_epoch(
                cfg, device, elementwise_per_batch=name not in PER_SAMPLE_TAIL, dict_batches=dicts
            ),
            "hand-written": handwritten_epoch(cfg, device, dict_batches=dicts),
        }
        for epoch in contenders.values():
            epoch()  # warm-up: allocator, caches, lazy initialisation
        # An epoch of these workloads takes ~0.1 s on a CPU, short enough for scheduler noise to move a single
        # timing by several percent: each sample times as many epochs as fill about half a second.
        start = time.perf_counter()
        contenders["hand-written"]()
        epochs = 1 if args.smoke else max(1, math.ceil(0.5 / (time.perf_counter() - start)))
        samples = {label: [] for label in contenders}
        for _ in range(args.repeats):
            for label, epoch in contenders.items():
                samples[label].append(timed(epoch, device, epochs))
        # The ratio is the median of each back-to-back pair's: load that drifts between pairs cancels out.
        pairs = [ours / theirs for ours, theirs in zip(samples["hydraloop"], samples["hand-written"])]
        rows.append(
            {
                "workload": name,
                "hydraloop_samples_per_s": statistics.median(samples["hydraloop"]),
                "handwritten_samples_per_s": statistics.median(samples["hand-written"]),
                "ratio": statistics.median(pairs),
                "epochs_per_sample": epochs,
                "samples": samples,
            }
        )
    return rows


def loop_throughput_in_processes(args) -> list[dict]:
    """(a) in `--loop-processes` fresh processes, each building both loops anew. Where a process's allocator puts each
    model's tensors moves a small CNN's step by a few percent either way: the same command, run twice back to back,
    gave 0.93 and 1.05. The ratio reported is the median of the processes' ratios."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.loop_processes):
            out = Path(tmp) / f"loop_{i}.json"
            # Only (a)'s figures are read back.
            others = ["startup", "ddp", "images", "lightning", "memory", "hf_trainer"]
            one_process = ["--loop-processes", "1", "--skip", *others, "--out", str(out)]
            one_process += ["--workloads", *args.workloads, *(["--smoke"] if args.smoke else [])]
            options = ["--repeats", str(args.repeats), "--device", args.device, "--precision", args.precision]
            subprocess.run([sys.executable, BENCHMARK, *options, *one_process], check=True, capture_output=True)
            runs.append(json.loads(out.read_text())["loop"])
    return [
        {
            "workload": per_process[0]["workload"],
            "hydraloop_samples_per_s": statistics.median(row["hydraloop_samples_per_s"] for row in per_process),
            "handwritten_samples_per_s": statistics.median(row["handwritten_samples_per_s"] for row in per_process),
            "ratio": statistics.median(row["ratio"] for row in per_process),
            "processes": list(per_process),
        }
        for per_process in zip(*runs)
    ]


def image_loader_throughput(args, device: torch.device) -> list[dict]:
    """(d): hydraloop's training loader alone, one epoch at a time, after a first epoch that starts the workers."""
    cfg = compose_config(IMAGE_FOLDER)
    rows = []
    for per_batch, workers in itertools.product((True, False), (0, 1, 2)):
        train_set, val_set = instantiate(cfg.data.dataset)
        loader, _ = build_loaders(
            *(train_set, val_set),
            global_batch_size=cfg.data.batch_size,
            global_val_batch_size=cfg.data.batch_size,
            rank=0,
            world_size=1,
            seed=cfg.seed,
            num_workers=workers,
            drop_last=True,
            device=device,
            elementwise_per_batch=per_batch,
            limit_train_batches=SMOKE_BATCHES if args.smoke else None,
        )
        epoch = loading_epochs(loader)
        epoch()
        rates = [timed(epoch, device) for _ in range(args.repeats)]
        rows.append(
            {
                "workers": workers,
                "todtype_normalize": "per batch" if per_batch else "per sample",
                "images_per_s": statistics.median(rates),
                "samples": rates,
            }
        )
        del loader, epoch  # its persistent workers end here, not while the next setting is timed
        gc.collect()
    return rows
