"""What a run of `python src/train.py` leaves behind, for scripts/stop_campaign.py and its tests: any file in its
TMPDIR but torch's compile cache, its processes (each carries a marker in its environment), the shared memory it
made, and whether the checkpoints a stop left read back whole."""

import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# What may stay in TMPDIR, by design and not per run: torch's compile cache, made by importing torch._dynamo.
KEPT = "torchinductor_"
MARKER = "HYDRALOOP_STOP_CAMPAIGN"


def environment(tmpdir: Path, marker: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment) with TMPDIR, the marker, and the repository and src/ to import from."""
    env = dict(base or os.environ, TMPDIR=str(tmpdir), HYDRA_FULL_ERROR="0", **{MARKER: marker})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def read_checkpoint(path: Path) -> dict:
    """A checkpoint whole: a file, or parallel=fsdp's sharded folder."""
    if path.is_dir():
        sys.path.insert(0, str(REPO / "src"))
        from hydraloop.checkpoint import load_checkpoint

        return load_checkpoint(path)
    return torch.load(path, weights_only=True)


def checkpoints_after_a_stop(run_dir: Path) -> tuple[int | None, list[str]]:
    """The step last.pt holds (None: none written), and what in checkpoints/ is not whole: a write left unfinished
    (`*.tmp`), a checkpoint that does not read back, a last.pt other than the newest step-named one."""
    folder, steps, problems = run_dir / "checkpoints", {}, []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.endswith(".tmp"):
            problems.append(f"{path.name}: a write left unfinished")
            continue
        try:
            steps[path.name] = read_checkpoint(path)["global_step"]
        except Exception as error:  # what a damaged one raises is the finding
            problems.append(f"{path.name}: {type(error).__name__}: {error}")
    newest = max((step for name, step in steps.items() if name.startswith("step-")), default=None)
    if steps.get("last.pt") != newest:
        problems.append(f"last.pt holds step {steps.get('last.pt')}, the newest step-named one {newest}")
    return steps.get("last.pt"), problems


def processes_marked(marker: str) -> list[str]:
    """The processes whose environment holds `MARKER=marker`: a run's launcher, ranks, loader workers, their
    servers and trackers (every process it starts inherits it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"{MARKER}={marker}".encode() in environ:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:100].decode()
                found.append(f"{pid} {cmdline}")
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


def shared_memory() -> set[str]:
    """The named shared memory and semaphores on this machine (/dev/shm): a loader's workers' tensors, multiprocessing's
    locks (those of a spawned process's queues keep their names while they live)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def unmapped(names: set[str]) -> set[str]:
    """Those of `names` (in /dev/shm) that no running process maps: what the runs of others going on meanwhile (a
    test suite's) made is theirs while they run."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.rsplit("/dev/shm/", 1)[1].strip() for line in maps.read_text().splitlines() if "/dev/shm/" in line
            )
        except (OSError, IndexError):  # ended meanwhile, or another's
            continue
    return names - mapped


def left_behind(tmpdir: Path, marker: str, shared_before: set[str] | None = None, wait_s: float = 5.0) -> list[str]:
    """What a run left: files in `tmpdir`, its processes still running `wait_s` after it ended, and
    shared memory made since `shared_before` (this machine's before the run) still there."""
    deadline = time.monotonic() + wait_s
    while (processes := processes_marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    files = [path.name for path in tmpdir.iterdir() if not path.name.startswith(KEPT)]
    shared = sorted(unmapped(shared_memory() - shared_before)) if shared_before is not None else []
    return files + [f"process {line}" for line in processes] + [f"shared memory {name}" for name in shared]
