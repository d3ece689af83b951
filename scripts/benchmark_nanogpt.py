"""(g) nanoGPT's own CPU benchmark, side by side: `experiment=nanogpt_shakespeare_char_cpu` against nanoGPT's
train.py with the settings its README gives for a CPU (the baby GPT at 4 x 128, block 64, batch 12, 2000 iterations)
on tiny Shakespeare, several seeds each, every run's final weights scored the same way here: the loss over the whole
validation split, every window of 64 tokens at stride 64 (the recipe's val/loss; nanoGPT's 20-batch estimates move by
0.01 from one draw to the next). Also each whole command's time, side by side: for each seed the commands run in
turn, and the ratio is of that seed's pair.

    python scripts/benchmark_nanogpt.py --text tinyshakespeare.txt [--nanogpt ~/nanoGPT] [--seeds 0 1 2]

Two hydraloop commands per seed. *As shipped*, the recipe validates on the whole split (1742 windows) at each of its
9 validations; nanoGPT estimates both losses from 20 batches of 12 windows each of the train and validation splits
(480 windows) at each of its 9 evaluations: the recipe's validations are 3.6x nanoGPT's forward passes. *Equal work*
adds `data.dataset.val_windows=480`: as many windows per validation as nanoGPT's evaluation forwards. Both are timed
against the one nanoGPT run. Also, measured in this process first, the recipe's training loop against a hand-written
loop over the same model (nanoGPT's `get_batch`, forward, backward, clipping, step): milliseconds per step.

Neither is shipped: the corpus is the tinyshakespeare input.txt that nanoGPT's data/shakespeare_char/prepare.py
downloads, nanoGPT a checkout of github.com/karpathy/nanoGPT (its model.py is what scores its checkpoints). Without
--nanogpt only hydraloop's runs are made. Both read the same token files (scripts/prepare_text.py writes the ids
nanoGPT's prepare.py writes; a meta.pkl beside them gives nanoGPT the vocabulary size). nanoGPT's train.py seeds
torch with 1337 whatever its arguments, so each seed runs a copy of it with that one line changed; and it is told to
save its checkpoint at every evaluation (--always_save_checkpoint=True): its README's command keeps the one with the
best noisy estimate, which need not be the last.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

import benchmark_loops  # noqa: E402
from sample import load_language_model  # noqa: E402

from hydraloop.config import register_configs  # noqa: E402

BLOCK = 64  # both recipes' block_size
SEED_LINE = "torch.manual_seed(1337 + seed_offset)"
NANOGPT_CPU = [  # nanoGPT README's "I only have a macbook" command, and a checkpoint at the last evaluation
    "config/train_shakespeare_char.py",
    *["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12"],
    *["--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0", "--always_save_checkpoint=True"],
]
NANOGPT_EVAL_WINDOWS = 2 * 20 * 12  # an evaluation's forward passes: eval_iters batches of 12, train and val splits


def whole_val_loss(loss_of, val: np.ndarray) -> float:
    """The mean next-token loss over every window of BLOCK tokens at stride BLOCK; `loss_of(x, y)`: a batch's mean."""
    windows = (len(val) - BLOCK - 1) // BLOCK + 1
    total = 0.0
    with torch.no_grad():
        for first in range(0, windows, 256):
            starts = [i * BLOCK for i in range(first, min(windows, first + 256))]
            x = torch.stack([torch.from_numpy(val[s : s + BLOCK].astype(np.int64)) for s in starts])
            y = torch.stack([torch.from_numpy(val[s + 1 : s + 1 + BLOCK].astype(np.int64)) for s in starts])
            total += float(loss_of(x, y)) * len(starts)
    return total / windows


def timed_run(command: list[str], cwd: Path, log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:  # the log goes with the temporary folder: its last lines say why
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(
            f"benchmark_nanogpt: {' '.join(map(str, command[:3]))} ... exited {proc.returncode}: {tail[0]}"
        )
    return time.perf_counter() - start


def warmup(steps: int) -> int:
    """Both recipes warm up for 100 of 2000 steps; a shorter run (the test's) keeps that share."""
    return max(1, round(100 * steps / 2000))


def hydraloop_run(tokens: Path, seed: int, steps: int, work: Path, val: np.ndarray, equal_work: bool = False) -> dict:
    run_dir = work / f"hydraloop-{seed}{'-equal' if equal_work else ''}"
    command = [sys.executable, str(REPO / "src" / "train.py"), "experiment=nanogpt_shakespeare_char_cpu"]
    command += [f"data.dataset.dir={tokens}", f"seed={seed}", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    command += [f"scheduler.warmup_steps={warmup(steps)}"]
    command += [f"data.dataset.val_windows={NANOGPT_EVAL_WINDOWS}"] if equal_work else []
    wall = timed_run(command, REPO, run_dir.with_suffix(".log"))
    model, *_ = load_language_model(run_dir / "checkpoints" / "last.pt", torch.device("cpu"))
    logged = json.loads((run_dir / "metrics.json").read_text())["val/loss"]
    scored = whole_val_loss(lambda x, y: torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()), val)
    return {"seed": seed, "val_loss": scored, "logged_val_loss": logged, "wall_s": wall}


def nanogpt_run(checkout: Path, tokens: Path, seed: int, steps: int, work: Path, val: np.ndarray) -> dict:
    copy = work / f"nanogpt-{seed}"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "data", "out*"))
    train = (copy / "train.py").read_text()
    (copy / "train.py").write_text(train.replace(SEED_LINE, f"torch.manual_seed({seed} + seed_offset)"))
    data = copy / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    for split in ("train.bin", "val.bin"):
        (data / split).symlink_to(tokens / split)
    vocab_size = json.loads((tokens / "meta.json").read_text())["vocab_size"]
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab_size}))
    command = [sys.executable, "train.py", *NANOGPT_CPU, f"--max_iters={steps}", f"--lr_decay_iters={steps}"]
    # It saves at an evaluation (every 250 iterations) after the first; its evaluations draw from the training RNG,
    # so a 2000-step run keeps the README's interval.
    command += [f"--warmup_iters={warmup(steps)}", f"--eval_interval={min(250, steps)}"]
    wall = timed_run(command + ["--out_dir=out"], copy, work / f"nanogpt-{seed}.log")
    checkpoint = torch.load(copy / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    spec = importlib.util.spec_from_file_location(f"nanogpt_model_{seed}", copy / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):  # its "number of parameters" line, amid the table
        model = module.GPT(module.GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict({key.removeprefix("_orig_mod."): value for key, value in checkpoint["model"].items()})
    model.eval()
    scored = whole_val_loss(lambda x, y: model(x, y)[1], val)
    return {"seed": seed, "val_loss": scored, "iter_num": checkpoint["iter_num"], "wall_s": wall}


def check_nanogpt(checkout: Path) -> None:
    train = checkout / "train.py"
    if not (train.is_file() and (checkout / "model.py").is_file()):
        raise SystemExit(f"--nanogpt {checkout}: not a nanoGPT checkout (no train.py and model.py there)")
    if SEED_LINE not in train.read_text():
        raise SystemExit(f"--nanogpt {checkout}: its train.py has no line '{SEED_LINE}' to set each seed in")


def measure(args: argparse.Namespace) -> dict:
    """Prepares the corpus, times the loops, runs each seed of hydraloop (and nanoGPT), prints and returns the
    figures."""
    if args.nanogpt is not None:
        check_nanogpt(args.nanogpt)
    if not args.text.is_file():
        raise SystemExit(f"--text {args.text}: no such file")
    with tempfile.TemporaryDirectory(prefix="benchmark_nanogpt-") as tmp:
        work = Path(tmp)
        tokens = work / "tokens"
        prepare = [sys.executable, str(REPO / "scripts" / "prepare_text.py"), str(args.text), str(tokens)]
        subprocess.run(prepare, check=True, capture_output=True)
        val = np.memmap(tokens / "val.bin", dtype=np.uint16, mode="r")
        report = {"steps": args.steps, "hydraloop": [], "equal_work": [], "nanogpt": []}
        report["loop_ms_per_step"] = loop_against_handwritten(tokens, args.loop_steps, args.loop_rounds)
        for seed in args.seeds:
            report["hydraloop"].append(hydraloop_run(tokens, seed, args.steps, work, val))
            if args.nanogpt is not None:
                report["nanogpt"].append(nanogpt_run(args.nanogpt, tokens, seed, args.steps, work, val))
                report["equal_work"].append(hydraloop_run(tokens, seed, args.steps, work, val, equal_work=True))
            print_report(report)
    return report


def loop_against_handwritten(tokens: Path, steps: int, rounds: int) -> dict:
    """Milliseconds per training step of the recipe's loop (built as src/train.py builds it) and of a hand-written
    loop over the same model and batches, timed in turn, `rounds` epochs of `steps` steps each after one to warm up;
    medians."""
    register_configs()
    overrides = ["experiment=nanogpt_shakespeare_char_cpu", f"data.dataset.dir={tokens}"]
    cfg = benchmark_loops.compose_config([*overrides, f"trainer.limit_train_batches={steps}"])
    device = torch.device("cpu")
    loops = {
        "hydraloop": benchmark_loops.hydraloop_epoch(cfg, device),
        "hand-written": benchmark_loops.handwritten_epoch(cfg, device),
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    for round_ in range(rounds + 1):
        for name, epoch in loops.items():
            start = time.perf_counter()
            epoch()
            if round_:
                times[name].append((time.perf_counter() - start) * 1000 / steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"training loop, {rounds} x {steps} steps: hydraloop {medians['hydraloop']:.1f} ms/step, hand-written "
        f"{medians['hand-written']:.1f} ms/step, ratio {medians['hydraloop'] / medians['hand-written']:.3f}"
    )
    return medians


def cell(run: dict | None) -> str:
    return f"{run['val_loss']:.4f} ({run['wall_s']:.0f} s)" if run else "-"


def print_report(report: dict) -> None:
    print(f"\nwhole-validation loss after {report['steps']} steps (seconds: the whole command; ratios: to nanoGPT's)")
    print(f"{'seed':>6}  {'as shipped':<18}{'equal work':<18}{'nanoGPT':<18}ratios")
    nanogpt = {run["seed"]: run for run in report["nanogpt"]}
    equal = {run["seed"]: run for run in report["equal_work"]}
    for run in report["hydraloop"]:
        peer, same = nanogpt.get(run["seed"]), equal.get(run["seed"])
        ratios = f"{run['wall_s'] / peer['wall_s']:.3f}, {same['wall_s'] / peer['wall_s']:.3f}" if peer and same else ""
        print(f"{run['seed']:>6}  {cell(run):<18}{cell(same):<18}{cell(peer):<18}{ratios}")
    runs = [report["hydraloop"], report["equal_work"], report["nanogpt"]]
    line = f"{'mean':>6}  " + "".join(
        f"{statistics.mean(r['val_loss'] for r in who):<18.4f}" if who else f"{'-':<18}" for who in runs
    )
    if len(report["equal_work"]) == len(report["nanogpt"]) == len(report["hydraloop"]):
        pairs = [zip(who, report["nanogpt"], strict=True) for who in runs[:2]]
        medians = [statistics.median(a["wall_s"] / b["wall_s"] for a, b in pair) for pair in pairs]
        line += f"{medians[0]:.3f}, {medians[1]:.3f} (medians)"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, required=True, help="tiny Shakespeare's input.txt")
    parser.add_argument("--nanogpt", type=Path, default=None, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--loop-steps", type=int, default=100, help="the training loops' timing: steps a round")
    parser.add_argument("--loop-rounds", type=int, default=3, help="the training loops' timing: rounds, in turn")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark_nanogpt.json")
    args = parser.parse_args()
    report = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
