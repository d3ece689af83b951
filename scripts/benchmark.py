"""Measures what hydraloop costs against plain PyTorch, side by side in one invocation.

    python scripts/benchmark.py [--repeats 5] [--loop-processes 3] [--out outputs/benchmark.json] [--device auto]
                                [--precision 32] [--smoke]

(a) Loop throughput: hydraloop's Trainer.train_epoch against a minimal hand-written loop on the same model, data,
    global batch, optimizer and precision, samples interleaved (A B A B ...) so drifting machine load hits both,
    in several fresh processes.
(b) Start-up: `python src/train.py` up to its first training step (one step, one validation batch) against
    `python -c "import torch"`.
(c) parallel=dataparallel and parallel=ddp with 1 and 2 processes (`--ddp-procs`) against parallel=single, as whole
    commands; and ddp with the most processes again without its replica check (trainer.replica_check_every_n_steps=0):
    the check's cost at its default, before each validation and checkpoint; and with a loader worker per rank
    (data.num_workers=1): the whole command's time, fork servers' start included, beside the row without workers.
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
(h) Against transformers' Trainer (scripts/benchmark_hf_trainer.py, which also runs alone; the `hf` extra and
    accelerate, in `bench`; skipped with a note without them): a BERT classifier fine-tune and a GPT-2 language model
    (2 layers of 64, dropout 0.1) on a 4000-row csv of the plays' lines, same model, data, batch, optimizer and
    schedule; hydraloop's loop against `Trainer.train()`, both as shipped (hydraloop's keyed dropout on) and at equal
    work (torch's dropout, the same AdamW kernel): samples/s of the training loop and a 3-epoch command's time.

Prints a table and writes the figures as JSON. Medians throughout; (a)'s ratio is the median over processes of
each process's median ratio of back-to-back pairs, the others are ratios of medians measured in this run.
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  frozen below with the rest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

from benchmark_commands import NO_REPLICA_CHECK, ddp_scaling, startup  # noqa: E402
from benchmark_hf_trainer import EPOCHS as HF_EPOCHS  # noqa: E402
from benchmark_hf_trainer import ROWS as HF_ROWS  # noqa: E402
from benchmark_hf_trainer import WORKLOADS as HF_WORKLOADS  # noqa: E402
from benchmark_hf_trainer import measure as measure_hf_trainer  # noqa: E402
from benchmark_hf_trainer import missing_note as hf_trainer_missing  # noqa: E402
from benchmark_hf_trainer import print_report as print_hf_trainer  # noqa: E402
from benchmark_lightning import available as lightning_available  # noqa: E402
from benchmark_lightning import command_line_runs, lightning_throughput  # noqa: E402
from benchmark_loops import LARGER_FILES, TOKEN_DIR, WORKLOADS, chosen_device, report_header  # noqa: E402
from benchmark_memory import SIZES as MEMORY_SIZES  # noqa: E402
from benchmark_memory import STRATEGIES  # noqa: E402
from benchmark_memory import measure as measure_memory  # noqa: E402
from benchmark_memory import print_report as print_memory  # noqa: E402
from benchmark_throughput import image_loader_throughput, loop_throughput, loop_throughput_in_processes  # noqa: E402
from make_image_folder import DEFAULT_ROOT, write_digits  # noqa: E402
from prepare_text import prepare_default as prepare_tokens  # noqa: E402

from hydraloop.config import register_configs  # noqa: E402
from hydraloop.errors import ConfigError  # noqa: E402
from hydraloop.parallel.single import resolve_device  # noqa: E402
from hydraloop.storage import check_makeable  # noqa: E402

# Both loops run in the process state src/train.py gives its own: what the imports made (torch._dynamo included,
# which every optimizer imports) frozen out of later collections. Otherwise a full collection, ~0.2 s over torch's
# objects, lands now and then in one contender's sample.
gc.freeze()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="each section's code at the least work (2 batches an epoch, an epoch a sample): the figures mean nothing",
    )
    parser.add_argument("--loop-processes", type=int, default=3, help="(a) is measured in this many processes")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark.json")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["loop", "startup", "ddp", "images", "lightning", "memory", "hf_trainer"],
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
    device = chosen_device(args.device)
    report = {
        **report_header(device, args.precision),
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
    if "hf_trainer" not in args.skip and hf_trainer_missing():
        print(f"\n(h) transformers' Trainer: skipped, {hf_trainer_missing()}")
    elif "hf_trainer" not in args.skip:
        hf_args = argparse.Namespace(
            repeats=args.repeats,
            epochs=HF_EPOCHS,
            workloads=list(HF_WORKLOADS),
            rows=HF_ROWS,
            device=args.device,
            precision=args.precision,
        )
        report["hf_trainer"] = measure_hf_trainer(hf_args, device)
        print_hf_trainer(report["hf_trainer"], args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
