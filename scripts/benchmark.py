"""Measures what hydraloop costs against plain PyTorch, side by side in one invocation.

    python scripts/benchmark.py [--repeats 5] [--loop-processes 3] [--out outputs/benchmark.json] [--device auto]
                                [--precision 32]

(a) Loop throughput: hydraloop's Trainer.train_epoch against a minimal hand-written loop on the same model, data,
    global batch, optimizer and precision, samples interleaved (A B A B ...) so drifting machine load hits both,
    in several fresh processes.
(b) Start-up: `python src/train.py` up to its first training step (one step, one validation batch) against
    `python -c "import torch"`.
(c) parallel=dataparallel and parallel=ddp with 1 and 2 processes (`--ddp-procs`) against parallel=single, as whole
    commands; and ddp with the most processes again without its replica check (trainer.replica_check_every_n_steps=0):
    the check's cost at its default, before each validation and checkpoint.
(d) Images per second through hydraloop's training loader over an image folder (scripts/make_image_folder.py's
    digits, 16x16 random crops and flips, seeded per sample) with 0, 1 and 2 worker processes, the transforms'
    closing ToDtype and Normalize run per batch (hydraloop's way) and per sample. (a) also runs a small CNN on that
    folder against a hand-written ImageFolder loop with as many workers, and the GPT fed dict batches against a
    hand-written dict loop.
(e) Against Lightning's Trainer (the `bench` extra; skipped with a note without it): throughput on the same model and
    batches, Lightning quiet (no logger, checkpoints, progress bar) and with its defaults, and a 1-epoch digits run
    from the command line, start-up to exit, each with its defaults.
(f) Memory (scripts/benchmark_memory.py, which also runs alone with more options): each rank's peak memory for the
    GPT at two sizes under single, ddp and fsdp, with and without activation checkpointing, through a save and a
    resume; and the stall of a checkpoint written synchronously and in the background.
(g) nanoGPT's own CPU benchmark, the losses after 2000 steps over several seeds, is scripts/benchmark_nanogpt.py,
    run alone: it needs tiny Shakespeare and a nanoGPT checkout (neither shipped) and about 4 minutes a seed.

Prints a table and writes the figures as JSON. Medians throughout; (a)'s ratio is the median over processes of
each process's median ratio of back-to-back pairs, the others are ratios of medians measured in this run.
"""

import argparse
import gc
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  frozen below with the rest
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

from benchmark_commands import NO_REPLICA_CHECK, ddp_scaling, startup  # noqa: E402
from benchmark_lightning import available as lightning_available  # noqa: E402
from benchmark_lightning import command_line_runs, lightning_epoch_rates  # noqa: E402
from benchmark_loops import (  # noqa: E402
    DICT_BATCHES,
    IMAGE_FOLDER,
    LARGER_FILES,
    PER_SAMPLE_TAIL,
    TOKEN_DIR,
    WORKLOADS,
    compose_config,
    handwritten_epoch,
    hydraloop_epoch,
    loading_epochs,
    timed,
)
from benchmark_memory import SIZES as MEMORY_SIZES  # noqa: E402
from benchmark_memory import STRATEGIES  # noqa: E402
from benchmark_memory import measure as measure_memory  # noqa: E402
from benchmark_memory import print_report as print_memory  # noqa: E402
from make_image_folder import DEFAULT_ROOT, write_digits  # noqa: E402
from prepare_text import prepare_default as prepare_tokens  # noqa: E402

from hydraloop.config import register_configs  # noqa: E402
from hydraloop.data.loaders import build_loaders  # noqa: E402
from hydraloop.errors import ConfigError  # noqa: E402
from hydraloop.parallel.single import resolve_device  # noqa: E402
from hydraloop.storage import check_makeable  # noqa: E402

# Both loops run in the process state src/train.py gives its own: what the imports made (torch._dynamo included,
# which every optimizer imports) frozen out of later collections. Otherwise a full collection, ~0.2 s over torch's
# objects, lands now and then in one contender's sample.
gc.freeze()


def loop_throughput(args, device: torch.device) -> list[dict]:
    rows = []
    for name in args.workloads:
        overrides = WORKLOADS[name]
        cfg = compose_config([*overrides, f"trainer.precision={args.precision}"])
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
        epochs = max(1, math.ceil(0.5 / (time.perf_counter() - start)))
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
            others = ["startup", "ddp", "images", "lightning", "memory"]  # only (a)'s figures are read back
            one_process = ["--loop-processes", "1", "--skip", *others, "--out", str(out)]
            one_process += ["--workloads", *args.workloads]
            options = ["--repeats", str(args.repeats), "--device", args.device, "--precision", args.precision]
            subprocess.run([sys.executable, __file__, *options, *one_process], check=True, capture_output=True)
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


def lightning_throughput(args, device: torch.device) -> list[dict]:
    """(e): hydraloop's loop against Lightning's Trainer on the same model and batches, in one process, samples taken
    in turn; Lightning quiet (no logger, checkpoints or progress bar) and with its defaults."""
    rows = []
    for name in args.lightning_workloads:
        cfg = compose_config([*WORKLOADS[name], f"trainer.precision={args.precision}"])
        hydraloop = hydraloop_epoch(cfg, device)
        hydraloop()  # warm-up
        start = time.perf_counter()
        hydraloop()
        epochs = max(1, math.ceil(0.5 / (time.perf_counter() - start)))
        samples = {"hydraloop": [], "Lightning, quiet": [], "Lightning, defaults": []}
        for _ in range(args.repeats):
            samples["hydraloop"].append(timed(hydraloop, device, epochs))
            samples["Lightning, quiet"].append(lightning_epoch_rates(cfg, device, defaults=False, epochs=epochs))
            samples["Lightning, defaults"].append(lightning_epoch_rates(cfg, device, defaults=True, epochs=epochs))
        ratios = {
            label: statistics.median(ours / theirs for ours, theirs in zip(samples["hydraloop"], samples[label]))
            for label in ("Lightning, quiet", "Lightning, defaults")
        }
        rows.append(
            {
                "workload": name,
                "ratio_vs_quiet": ratios["Lightning, quiet"],
                "ratio_vs_defaults": ratios["Lightning, defaults"],
                "samples_per_s": {k: statistics.median(v) for k, v in samples.items()},
                "samples": samples,
            }
        )
    return rows


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-processes", type=int, default=3, help="(a) is measured in this many processes")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark.json")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["loop", "startup", "ddp", "images", "lightning", "memory"]
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), help="(a)'s")
    parser.add_argument("--ddp-procs", nargs="+", type=int, default=[1, 2], help="(c): parallel=ddp with these many")
    parser.add_argument(
        "--lightning-workloads", nargs="+", default=["synthetic MLP", "MNIST-1D CNN", "GPT"], choices=list(WORKLOADS)
    )
    args = parser.parse_args()
    counts = (
        ("--repeats", [args.repeats]),
        ("--loop-processes", [args.loop_processes]),
        ("--ddp-procs", args.ddp_procs),
    )
    for flag, values in counts:
        if min(values) < 1:
            parser.error(f"{flag} {' '.join(map(str, values))}: must be at least 1")
    try:
        resolve_device(args.device)  # auto, cpu, cuda, cuda:N; and CUDA there
    except ConfigError as error:
        parser.error(str(error).replace("device=", "--device ", 1))
    try:
        check_makeable(args.out.parent, "--out")  # before the measurements, which take minutes
    except ConfigError as error:
        parser.error(str(error))
    register_configs()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )

    report = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(),
        },
        "precision": args.precision,
        "date": time.strftime("%Y-%m-%d"),
    }
    write_digits(DEFAULT_ROOT)  # the image folders of (a) and (d), unless they are there
    write_digits(LARGER_FILES, size=128)
    prepare_tokens(TOKEN_DIR)
    if "loop" not in args.skip:
        one = args.loop_processes == 1
        report["loop"] = loop_throughput(args, device) if one else loop_throughput_in_processes(args)
        print(
            f"\n(a) loop throughput, samples/s: {args.repeats} interleaved pairs in each of {args.loop_processes} "
            "process(es); medians"
        )
        print(f"{'workload':<32}{'hydraloop':>12}{'hand-written':>14}{'ratio':>8}")
        for row in report["loop"]:
            print(
                f"{row['workload']:<32}{row['hydraloop_samples_per_s']:>12.0f}"
                f"{row['handwritten_samples_per_s']:>14.0f}{row['ratio']:>8.3f}"
            )
        rates = {row["workload"]: row["hydraloop_samples_per_s"] for row in report["loop"]}
        if {"GPT", "GPT, EMA"} <= rates.keys():
            report["ema_cost"] = rates["GPT"] / rates["GPT, EMA"] - 1
            print(f"EMA's cost: {100 * report['ema_cost']:.1f}% of a GPT step (hydraloop's rows, GPT against GPT, EMA)")
    if "startup" not in args.skip:
        report["startup"] = startup(args)
        s = report["startup"]
        print(
            f"\n(b) start-up (median of {args.repeats}): train.py to first step {s['train_py_first_step_s']:.2f} s; "
            f"import torch {s['import_torch_s']:.2f} s (overhead {s['overhead_vs_import_torch_s']:.2f} s); "
            f"hand-written first step {s['handwritten_first_step_s']:.2f} s "
            f"(overhead {s['overhead_vs_handwritten_s']:.2f} s), with the collector paused as train.py does "
            f"{s['handwritten_paused_first_step_s']:.2f} s (overhead {s['overhead_vs_handwritten_paused_s']:.2f} s)"
        )
    if "ddp" not in args.skip:
        report["ddp"] = ddp_scaling(args)
        print("\n(c) parallel strategies (whole command; loop samples/s from metrics.json)")
        print(f"{'variant':<24}{'wall s':>9}{'samples/s':>12}{'vs single':>11}")
        for row in report["ddp"]:
            print(
                f"{row['variant']:<24}{row['wall_s']:>9.2f}{row['samples_per_s']:>12.0f}{row['ratio_vs_single']:>11.3f}"
            )
        rates = {row["variant"]: row["samples_per_s"] for row in report["ddp"]}
        ranks = max(args.ddp_procs)
        unchecked = f"ddp x{ranks} {NO_REPLICA_CHECK}"
        if unchecked in rates:
            report["replica_check_cost"] = rates[unchecked] / rates[f"ddp x{ranks}"] - 1
            print(
                f"replica check's cost at its default: {100 * report['replica_check_cost']:.1f}% of ddp x{ranks}'s "
                f"throughput (against {unchecked}: trainer.replica_check_every_n_steps=0)"
            )
    if "images" not in args.skip:
        report["images"] = image_loader_throughput(args, device)
        print(f"\n(d) image folder through the training loader, images/s (median of {args.repeats} epochs)")
        for where in ("per batch", "per sample"):
            rows = [row for row in report["images"] if row["todtype_normalize"] == where]
            figures = "  ".join(f"{row['workers']} workers: {row['images_per_s']:.0f}" for row in rows)
            print(f"ToDtype, Normalize {where:<12}{figures}")
    if "lightning" not in args.skip and not lightning_available():
        print("\n(e) Lightning: skipped, lightning is not installed (pip install 'hydraloop[bench]')")
    elif "lightning" not in args.skip:
        report["lightning"] = {"loop": lightning_throughput(args, device), "command_line": command_line_runs(args)}
        print(f"\n(e) against Lightning's Trainer, same model and batches (median of {args.repeats} pairs)")
        print(f"{'workload':<32}{'hydraloop':>11}{'quiet':>10}{'defaults':>10}{'x quiet':>9}{'x defaults':>12}")
        for row in report["lightning"]["loop"]:
            rates = row["samples_per_s"]
            print(
                f"{row['workload']:<32}{rates['hydraloop']:>11.0f}{rates['Lightning, quiet']:>10.0f}"
                f"{rates['Lightning, defaults']:>10.0f}{row['ratio_vs_quiet']:>9.3f}{row['ratio_vs_defaults']:>12.3f}"
            )
        runs = report["lightning"]["command_line"]
        print(
            f"1-epoch digits run from the command line: hydraloop {runs['hydraloop_s']:.2f} s, Lightning "
            f"{runs['lightning_s']:.2f} s ({runs['ratio']:.2f}x)"
        )
    if "memory" not in args.skip:
        print("\n(f) memory: each rank's peak above the runtime's own, through a save and a resume")
        memory_args = argparse.Namespace(sizes=MEMORY_SIZES, ranks=2, strategies=list(STRATEGIES), repeats=args.repeats)
        report["memory"] = measure_memory(memory_args)
        print_memory(report["memory"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
