"""One live run per run directory: `run.lock` names the run that owns it (host, pid, job), and a second run into the
same directory is refused (exit 2) before it writes anything there.

A lock is stale, and taken over, when its process is gone (on this host: no such process, a zombie, or another
process under a reused pid), or when this process is a later attempt of the same job: a restart by torchrun, a SLURM
requeue (possibly on another node while the old allocation is still ending). A job is SLURM_JOB_ID, else torchrun's
TORCHELASTIC_RUN_ID (its --rdzv-id; --standalone makes a new one per torchrun), and its attempt counts
SLURM_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT. Two runs of one attempt, e.g. twice `python src/train.py` in one
`salloc` shell, are told apart by their processes. A lock held on another host by anything but an earlier attempt
cannot be checked: it refuses too, and the message names the file to delete if that run is known to be gone.

Spawned ranks (`parallel=ddp` from plain python) never touch the lock: the launcher holds it, and outlives the restarts
of its ranks (`parallel.max_restarts`). Under torchrun and SLURM every rank runs `main`, and rank 0 holds it.

Taking and releasing happen under flock(2) on the lock file, so that two runs starting at once cannot both take it.
"""

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hydraloop.errors import ConfigError
from hydraloop.preemption import stop_at_once
from hydraloop.storage import check_appendable, check_writable, describe

LOCK_FILE = "run.lock"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    """What run.lock holds: the process that owns the run directory."""

    host: str
    pid: int
    job: str
    """`slurm:<SLURM_JOB_ID>`, `torchrun:<TORCHELASTIC_RUN_ID>`, or "" (no job: the process alone)."""
    attempt: list[int] = field(default_factory=lambda: [0, 0])
    """[SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT]: a later attempt of the same job takes the lock over."""
    process_start: int = 0
    """The process's start in clock ticks after boot (Linux), telling a reused pid apart; 0: unknown."""
    since: str = ""

    @classmethod
    def this_process(cls) -> "Owner":
        env = os.environ
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        if env.get("SLURM_JOB_ID"):
            job = f"slurm:{env['SLURM_JOB_ID']}"
        elif run_id and run_id != "none":  # torchrun's default --rdzv-id, shared by unrelated jobs
            job = f"torchrun:{run_id}"
        else:
            job = ""
        attempt = [int(env.get("SLURM_RESTART_COUNT", 0)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))]
        start = _process_state(os.getpid())[1]
        return cls(socket.gethostname(), os.getpid(), job, attempt, start, time.strftime("%Y-%m-%d %H:%M:%S"))

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.since}"

    def stale_for(self, taker: "Owner") -> str | None:
        """Why `taker` may take this lock over, or None while it holds."""
        if self.job and self.job == taker.job and taker.attempt > self.attempt:
            return f"an earlier attempt of job {self.job}"
        if self.host != taker.host:
            return None  # its process cannot be looked at from here
        state, start = _process_state(self.pid)
        if state in ("", "Z") or (self.process_start and start != self.process_start):
            return "its process is gone"
        return None


@contextmanager
def owned_run_directory(run_dir: str | Path, log_file: str | Path, owner: bool = True) -> Iterator[None]:
    """Holds the run directory's lock while the run lasts, after checking that the directory, the folders in it and
    the job log can be written (else bad input, exit 2). Every exit path releases it, a stop signal's included: while
    the lock is held, one ends the process through the exception path (hydraloop.preemption.stop_at_once, exit 128 +
    its number), where the loop does not handle it. A killed process (SIGKILL, a crash) leaves a lock that the next
    run takes over. `owner=False` (ranks other than 0) holds nothing."""
    if not owner:
        yield
        return
    run_dir = Path(run_dir)
    me = None
    with stop_at_once():  # before the lock is taken: no signal ends the process between taking and releasing it
        try:
            try:
                me = take(run_dir)
                for folder in _written_folders(run_dir):
                    check_writable(folder, "run directory" if folder == run_dir else "run directory folder")
                check_appendable(Path(log_file), "job log")
            except ConfigError:
                # Someone else's directory, or one this run cannot write: the error line goes to the console only.
                _stop_logging_into(run_dir)
                raise
            yield
        finally:
            if me:
                release(run_dir, me)


def take(run_dir: Path) -> Owner:
    """Takes the lock of `run_dir` for this process, or raises ConfigError naming the live owner."""
    path = run_dir / LOCK_FILE
    me = Owner.this_process()
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise ConfigError(f"run directory {run_dir}: cannot be written: {describe(error)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _is_current(fd, path):
                continue  # its owner removed it while this process waited: take the new one
            holder = _read(fd)
            if holder is not None:
                why = holder.stale_for(me)
                if why is None:
                    raise ConfigError(_in_use_message(run_dir, path, holder, me))
                log.info("%s: taking over the lock of %s (%s)", path, holder.describe(), why)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
                os.fsync(fd)
            except OSError as error:
                raise ConfigError(f"run directory {run_dir}: cannot be written: {describe(error)}") from None
            return me
        finally:
            os.close(fd)  # and with it the flock


def release(run_dir: Path, me: Owner) -> None:
    """Removes the lock if it is still `me`'s (a later attempt of the job may have taken it over)."""
    path = run_dir / LOCK_FILE
    # A lock that cannot be removed (the directory became read-only, or is gone) is stale once this process ends.
    with suppress(OSError):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _is_current(fd, path) and _read(fd) == me:
                path.unlink()
        finally:
            os.close(fd)


def _written_folders(run_dir: Path) -> list[Path]:
    """The run directory and the folders in it that a run writes into (Hydra writes `.hydra` before `main`)."""
    return [run_dir, *(path for path in run_dir.iterdir() if path.is_dir() and path.name != ".hydra")]


def _in_use_message(run_dir: Path, path: Path, holder: Owner, me: Owner) -> str:
    message = f"run directory {run_dir}: in use by another run ({holder.describe()})"
    if holder.host != me.host:
        return f"{message}; if that run is gone, delete {path}"
    return f"{message}; wait for it to end, or give this run another hydra.run.dir"


def _read(fd: int) -> Owner | None:
    """The lock's owner; None for an empty or unreadable file (a crash between truncating and writing it)."""
    try:
        return Owner(**json.loads(os.pread(fd, 1 << 16, 0)))
    except (ValueError, TypeError):
        return None


def _is_current(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _process_state(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks after boot) of a process; ("", 0) for none. Elsewhere than Linux, where
    /proc is missing: ("?", 0) for a process that exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return ("", 0) if Path("/proc/self/stat").exists() else (_exists(pid), 0)
    except OSError:
        return "?", 0
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[19])


def _exists(pid: int) -> str:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass  # another user's process
    return "?"


def _stop_logging_into(run_dir: Path) -> None:
    """Detaches the job-log handlers that write into `run_dir` (Hydra opens train.log at its first line)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(run_dir.resolve()):
            root.removeHandler(handler)
            handler.close()
