"""Stop signals at chosen moments of a `python src/train.py parallel=ddp` run (or fsdp), and what each leaves.

Each try runs the command in a temporary folder of its own (TMPDIR) and sends SIGTERM to the launcher at one moment:
`launch` (a random instant in the first 2 s of the command, before its ranks start: Python's imports, the config, the
launcher's checks), `start` (a random instant while the ranks start: forked, spawned, joining the process group,
building), `first-step` (rank 0 inside step 1), `mid-epoch` (rank 0 inside step 13 of 44), `validation` (rank 0 inside
the validation at the end of epoch 1, at its batch 3 of 6) or `checkpoint` (rank 0 inside the write of that epoch's
checkpoint, step 22: torch.save has its file open; under fsdp the shards are in the staging directory and state.pt is
being written). Rank 0 waits there (tests/waits.py) until the signal is sent. The signal is SIGTERM, or in turn (shifted
at each round of the moments, so that each moment meets each) those --signals names: SIGINT (Ctrl-C: the ranks end at
once, without a checkpoint) or SIGTERM-twice (a second SIGTERM 0.2 s after the first), sent to the launcher or, in turn
with --to group, to its whole process group (as a terminal's Ctrl-C reaches the ranks too). It then checks that the stop
ended within --max-stop-s with exit 128 + the signal's number (or 0 with metrics.json: a run that finished before the
signal), that every checkpoint left reads back whole, last.pt the newest, and no write is left unfinished (*.tmp) (a
stop during a validation: at that validation's checkpoint), that no file is left in TMPDIR but torch's compile cache
(the agent's torchelastic_* and pytorch-errorfile-*, a rank's pymp-* were), no process of the run is left (each
carries a marker in its environment) and no shared memory it made (/dev/shm), and that the same command rerun ends
at the uninterrupted run's parameters (dropout included).

    python scripts/stop_campaign.py --tries 48                       # ddp, fork and spawn, the six moments
    python scripts/stop_campaign.py --tries 16 --parallel ddp fsdp --moments validation checkpoint
    python scripts/stop_campaign.py --tries 12 --parallel fsdp --out campaign.json
    python scripts/stop_campaign.py --tries 48 --parallel ddp fsdp --signals SIGTERM SIGINT SIGTERM-twice \
        --to launcher group

One line per try, then a summary; exit 1 if any try failed. tests/test_stop_campaign.py runs a few tries.
"""

import argparse
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from run_leftovers import (
    checkpoints_after_a_stop,
    environment,
    left_behind,
    read_checkpoint,
    shared_memory,
)

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "src" / "train.py"
RECIPE = ("trainer.max_epochs=2", "model.dropout=0.2", "trainer.log_every_n_steps=5", "logger=none")
# Where rank 0 waits for the signal: in training step N, in the validation after step N (its batch 3 of 6), or in
# the write of the checkpoint of step N (22: the end of epoch 1 of 2).
MOMENTS = {
    "launch": ("launch", None),
    "start": ("step", None),
    "first-step": ("step", 1),
    "mid-epoch": ("step", 13),
    "validation": ("validation", 22),
    "checkpoint": ("checkpoint", 22),
}
# How long after the ranks appear a `start` signal may come: about how long they take to reach step 1 on a busy 2-core
# machine (forked: 0.13 s after they appeared they were in training, and 0.84 s after, done: the 1 s window this was
# made most forked `start` tries stops in training or finished runs). The signal comes at rank 0's step 1 at the
# latest, where it waits; a try's delay_s is when it came.
START_WINDOW_S = {"fork": 0.1, "spawn": 4.0}
LAUNCH_WINDOW_S = 2.0  # a `launch` signal: this long at most after the command starts, before its ranks do
SIGNALS = {"SIGTERM": [signal.SIGTERM], "SIGINT": [signal.SIGINT], "SIGTERM-twice": [signal.SIGTERM, signal.SIGTERM]}


def command(
    parallel: str,
    start_method: str,
    run_dir: Path,
    faults: Path | None,
    where: str = "step",
    step: int = 1,
    workers: int = 0,
) -> list[str]:
    """The run's command, with `workers` loader workers per rank; with `faults`, rank 0 writes `faults/paused` in
    training step `step` (`where`: step), in the validation after it (validation) or in the write of its checkpoint
    (checkpoint), and waits there until `faults/resume` exists (tests/waits.py)."""
    overrides = [f"parallel={parallel}", f"parallel.start_method={start_method}", *RECIPE, f"hydra.run.dir={run_dir}"]
    overrides += [f"data.num_workers={workers}"]
    if faults is None:
        return [sys.executable, str(TRAIN), *overrides]
    files = {"pause_file": faults / "paused", "resume_file": faults / "resume"}
    if where == "checkpoint":
        overrides += [
            "+callbacks.waiting._target_=tests.waits.WaitingInCheckpointWrite",
            f"+callbacks.waiting.at_step={step}",
        ]
        overrides += [f"+callbacks.waiting.{name}={path}" for name, path in files.items()]
    else:
        model = "WaitingInValidationMLP" if where == "validation" else "WaitingInARankMLP"
        overrides += [f"model._target_=tests.waits.{model}", "+model.fail_rank=0", f"+model.fail_at_step={step}"]
        overrides += ["+model.at_batch=3"] if where == "validation" else []
        overrides += [f"+model.{name}={path}" for name, path in files.items()]
    return [sys.executable, str(TRAIN), *overrides]


def ranks_started(pid: int) -> bool:
    """Whether the launcher `pid` has a Python child: a rank, forked or spawned."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return any(b"python" in Path(f"/proc/{child}/cmdline").read_bytes() for child in children)
    except OSError:
        return False


def one_try(
    parallel: str,
    start_method: str,
    moment: str,
    folder: Path,
    reference: dict,
    rng: random.Random,
    sent: str,
    to: str = "launcher",
    shared: bool = True,
    workers: int = 0,
) -> dict:
    tmpdir, faults, run_dir = folder / "tmp", folder / "faults", folder / "run"
    for path in (tmpdir, faults):
        path.mkdir(parents=True)
    marker = uuid.uuid4().hex
    env = environment(tmpdir, marker)
    where, step = MOMENTS[moment]
    job_command = command(parallel, start_method, run_dir, faults, where, step or 1, workers)
    shared_before = shared_memory() if shared else None
    # A session of its own: its process group is the command's, which a terminal's Ctrl-C reaches as a whole.
    job = subprocess.Popen(
        job_command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        said_before = []
        if where == "launch":  # importing, composing the config, the launcher's checks: no rank yet
            started = time.monotonic()
            deadline = started + rng.uniform(0, LAUNCH_WINDOW_S)
            while time.monotonic() < deadline and not ranks_started(job.pid) and job.poll() is None:
                time.sleep(0.005)
        elif step is None:
            for line in job.stdout:  # the launcher has taken the run directory, and starts the ranks next
                said_before.append(line)
                if "run directory: " in line:
                    break
            while not ranks_started(job.pid) and job.poll() is None:
                time.sleep(0.01)
            started = time.monotonic()
        if where != "launch":
            deadline = started + rng.uniform(0, START_WINDOW_S[start_method]) if step is None else math.inf
            while time.monotonic() < deadline and not (faults / "paused").exists() and job.poll() is None:
                time.sleep(0.005)
        signalled = time.monotonic()
        delay = signalled - started if step is None else 0.0
        for number, signum in enumerate(SIGNALS[sent]):
            time.sleep(0.2 if number else 0.0)
            os.killpg(job.pid, signum) if to == "group" else job.send_signal(signum)
            (faults / "resume").touch()
        output = "".join(said_before) + job.communicate(timeout=180)[0]
        stop_s = time.monotonic() - signalled
    finally:
        (faults / "resume").touch()
        if job.poll() is None:
            job.kill()
    said = [line.split(" - ", 1)[-1] for line in output.splitlines() if "][hydraloop][ERROR]" in line]
    result = {"parallel": parallel, "start_method": start_method, "moment": moment, "delay_s": round(delay, 3)}
    result["signal"], result["to"] = sent, to
    result |= {"exit": job.returncode, "stop_s": round(stop_s, 2), "said": said[-1] if said else ""}
    result["left"] = left_behind(tmpdir, marker, shared_before)
    finished = (run_dir / "metrics.json").exists()
    # A run that finished before the signal: exit 0, or the signal's own where it came as the process ended
    # (docs/scaling-out.md); metrics.json says it finished either way.
    stopped = 128 + SIGNALS[sent][0]
    as_expected = job.returncode == stopped and not finished or job.returncode in (0, -SIGNALS[sent][0]) and finished
    # Before Python has installed hydraloop's handlers (its imports), the signal's default action ends the process:
    # a shell shows 128 + its number all the same, and there is nothing it could have written.
    as_expected |= where == "launch" and job.returncode == -SIGNALS[sent][0] and not run_dir.exists()
    result["problems"] = [] if as_expected else [f"exit {job.returncode}, metrics.json {finished}:\n{output[-3000:]}"]
    result["last_pt_step"], damaged = checkpoints_after_a_stop(run_dir)
    result["problems"] += [f"checkpoints: {'; '.join(damaged)}"] if damaged else []
    # A stop signal's votes travel in the validation's all-reduce (SIGINT ends the ranks at once instead).
    if where == "validation" and job.returncode == 143 and result["last_pt_step"] != step:
        result["problems"].append(f"a stop during step {step}'s validation stopped at step {result['last_pt_step']}")
    rerun = subprocess.run(job_command, env=env, capture_output=True, text=True, timeout=300)
    result["left"] += left_behind(tmpdir, marker, shared_before)
    if rerun.returncode != 0:
        result["problems"].append(f"rerun exit {rerun.returncode}:\n{(rerun.stdout + rerun.stderr)[-3000:]}")
    else:
        final = read_checkpoint(run_dir / "checkpoints" / "last.pt")
        result["resume_diff"] = max((final["model"][k] - v).abs().max().item() for k, v in reference.items())
    return result


def judge(result: dict, max_stop_s: float) -> list[str]:
    problems = list(result["problems"])
    if result["stop_s"] > max_stop_s:
        problems.append(f"the stop took {result['stop_s']} s")
    if result["left"]:
        problems.append(f"left behind: {result['left']}")
    if result.get("resume_diff", 1.0) > 1e-6:
        problems.append(f"the rerun ended {result.get('resume_diff')} away from the uninterrupted run")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=6, help="tries in all, over moments and start methods in turn")
    parser.add_argument("--parallel", nargs="+", default=["ddp"], choices=["ddp", "fsdp"])
    parser.add_argument("--start-methods", nargs="+", default=["fork", "spawn"], choices=["fork", "spawn"])
    parser.add_argument("--moments", nargs="+", default=list(MOMENTS), choices=list(MOMENTS))
    parser.add_argument("--signals", nargs="+", default=["SIGTERM"], choices=list(SIGNALS), help="sent in turn")
    parser.add_argument(
        "--to",
        nargs="+",
        default=["launcher"],
        choices=["launcher", "group"],
        help="whom the signal is sent to, in turn at each round of the moments: the launcher, or its process group "
        "(as a terminal's Ctrl-C reaches every rank too)",
    )
    parser.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count /dev/shm entries a try made and left (the machine's: off where other runs go on meanwhile)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="loader workers per rank (data.num_workers): a group's signal reaches them",
    )
    parser.add_argument("--max-stop-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0, help="of the random instants of `start` tries")
    parser.add_argument("--out", type=Path, help="a JSON file of every try")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="stop-campaign-") as root:
        references = {}
        for parallel in args.parallel:  # the uninterrupted run, its TMPDIR checked too
            tmpdir, marker = Path(root, f"reference-{parallel}", "tmp"), uuid.uuid4().hex
            tmpdir.mkdir(parents=True)
            run_dir, shared_before = tmpdir.parent / "run", shared_memory() if args.shared_memory else None
            done = subprocess.run(
                command(parallel, "auto", run_dir, None, workers=args.workers),
                env=environment(tmpdir, marker),
                capture_output=True,
                text=True,
            )
            left = left_behind(tmpdir, marker, shared_before)
            if done.returncode != 0 or left:
                print(f"uninterrupted {parallel} run: exit {done.returncode}, left {left}\n{done.stdout[-3000:]}")
                return 1
            references[parallel] = read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
        # Moments in turn, start methods shifted against them: a few tries already cover every moment and method.
        methods = args.start_methods
        plan = [
            (parallel, moment, methods[(i + j) % len(methods)])
            for parallel in args.parallel
            for i in range(len(methods))
            for j, moment in enumerate(args.moments)
        ]
        for number, (parallel, moment, start_method) in enumerate(itertools.islice(itertools.cycle(plan), args.tries)):
            folder = Path(root, f"try-{number}")
            # Shifted by one at each round of the moments: every moment meets every signal.
            sent = args.signals[(number + number // len(args.moments)) % len(args.signals)]
            to = args.to[number // len(args.moments) % len(args.to)]
            result = one_try(
                parallel,
                start_method,
                moment,
                folder,
                references[parallel],
                rng,
                sent,
                to=to,
                shared=args.shared_memory,
                workers=args.workers,
            )
            result["problems"] = judge(result, args.max_stop_s)
            failed += bool(result["problems"])
            results.append(result)
            verdict = "ok" if not result["problems"] else "FAILED: " + "; ".join(result["problems"])
            print(
                f"{number:3d} {parallel} {start_method:5s} {moment:10s} {sent:13s} to {to:8s} "
                f"delay {result['delay_s']:5.2f} "
                f"s: exit {result['exit']} in {result['stop_s']:5.2f} s, last.pt step {result['last_pt_step']}, rerun "
                f"{result.get('resume_diff', '-')}: {verdict} "
                f"({result['said']})",
                flush=True,
            )
            shutil.rmtree(folder, ignore_errors=True)
    slowest = max((result["stop_s"] for result in results), default=0.0)
    print(f"{len(results)} tries, {failed} failed; slowest stop {slowest:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
