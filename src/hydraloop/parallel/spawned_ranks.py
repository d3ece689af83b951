"""How parallel=ddp and fsdp start their own ranks, without torchrun: torch.distributed.elastic (`launch_ranks`),
forked or spawned (parallel.start_method; `forkable` says when a fork is whole), in a temporary folder of their own
(the agent's logs and error files), the first failed rank's error reported as the job's, and stop signals passed on
to the ranks, which decide together what they mean (hydraloop.parallel.rank_stops)."""

import atexit
import functools
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hydraloop.data.workers import start_resource_tracker
from hydraloop.errors import CTRL_C, ConfigError, Interrupted, StorageError, WorkerFailed
from hydraloop.parallel.rank_stops import (
    PASSED_ON,
    Stopped,
    interrupt_rank,
    mark_stopped_alone,
    passed_on_to_ranks,
    took_ctrl_c,
)
from hydraloop.preemption import (
    STOP_SIGNALS,
    loops_entered,
    raise_a_lost_stop,
    stop_at_once,
    stop_taken,
)

T = TypeVar("T")
SOCKET_PATH_MAX = 107  # a Unix socket's path: sun_path's 108 bytes, with its terminating NUL
log = logging.getLogger(__name__)

START_METHODS = ("auto", "fork", "spawn")


def _threads() -> int | None:
    """This process's threads, as Linux lists them; None elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


_threads_before_computing: int | None = None


def count_threads_before_computing() -> None:
    """Counts this process's threads once its imports are done and before it computes anything: what `forkable`
    compares with. src/train.py calls it at its import, so that a process running several jobs (Hydra's multirun, a
    joblib worker) counts before the first one. Importing torch leaves threads of its own (numpy's OpenBLAS pool,
    which re-creates itself in a forked child); a process that never counted spawns its ranks."""
    global _threads_before_computing
    _threads_before_computing = _threads()


def forkable() -> str | None:
    """Why a fork of this process would not be whole, or None where it would: no thread started since
    `count_threads_before_computing` (above all no OpenMP pool, which a computation on several threads leaves behind:
    a forked child's first parallel region would wait forever on threads it does not have) and no multiprocessing
    fork server of its own (a data loader's with workers: the fork's loaders would ask it for processes that are not
    their children). Either comes from an earlier job in the same process (a sweep's)."""
    threads = _threads()
    if threads is None or _threads_before_computing is None:
        return "this system does not list a process's threads"
    if threads > _threads_before_computing:
        return f"this process has started {threads - _threads_before_computing} threads since its imports"
    fork_server = getattr(multiprocessing.forkserver, "_forkserver", None)  # private: multiprocessing says no more
    if getattr(fork_server, "_forkserver_pid", None) is not None:
        return "this process has started a multiprocessing fork server"
    return None


# The launcher's process id, in the launcher and in the ranks it forks (a spawned rank imports this module afresh),
# and its temporary folder before launch_ranks gave the agent one of its own (which a forked rank takes back).
_forked_by: int | None = None
_tempdir: str | None = None


def launch_ranks(
    nproc_per_node: int,
    max_restarts: int,
    shutdown_timeout_s: float,
    start_method: str,
    worker: Callable[..., T],
    *args,
) -> T:
    """`worker(*args)` in `nproc_per_node` ranks that torch.distributed.elastic starts (hydraloop.parallel.ddp's
    DDPStrategy says how), and rank 0's result; a rank's failure and a stop signal end as hydraloop's errors.
    `start_method`: spawn or fork (parallel.start_method, resolved).

    The agent writes into a temporary folder of its own, removed when the ranks have ended, however they ended: its
    logs and the ranks' error files (`torchelastic_*` and, from torch.multiprocessing, `pytorch-errorfile-*`, which
    the agent would leave in the system's temporary folder), and the ranks' stops before training
    (hydraloop.parallel.rank_stops)."""
    raise_a_lost_stop()  # one a logging call swallowed meanwhile: no rank starts
    with tempfile.TemporaryDirectory(prefix="hydraloop-") as folder, _launcher_files_in(folder):
        return _launch(nproc_per_node, max_restarts, shutdown_timeout_s, start_method, Path(folder), worker, *args)


@contextmanager
def _launcher_files_in(folder: str) -> Iterator[None]:
    """The launcher's temporary files in `folder` while it lasts (torch.multiprocessing's error files, which elastic
    never removes). A forked rank takes back the folder it replaced, then keeps its own files in `folder` too."""
    global _tempdir
    _tempdir, tempfile.tempdir = tempfile.tempdir, folder  # None: from the environment (TMPDIR), at its next use
    try:
        yield
    finally:
        tempfile.tempdir, _tempdir = _tempdir, None


def _launch(
    nproc_per_node: int,
    max_restarts: int,
    shutdown_timeout_s: float,
    start_method: str,
    folder: Path,
    worker: Callable[..., T],
    *args,
) -> T:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # port 0: the agent binds a free port and tells the workers
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        # What ends the ranks at once; the stop signals and SIGINT are passed on by passed_on_to_ranks.
        signals_to_handle="SIGHUP,SIGQUIT",
        shutdown_timeout=int(shutdown_timeout_s),  # how long the ranks get to end on those before SIGKILL
        logs_specs=DefaultLogsSpecs(log_dir=str(folder / "agent")),
    )
    if start_method == "fork":
        global _forked_by
        _forked_by = os.getpid()
    # The agent reports each rank's failure with a full traceback; the worker has already logged it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    start_resource_tracker()  # the ranks' too: one that a scheduler's SIGUSR1 to every process does not end
    marks = folder / "stopped"
    marks.mkdir()
    with passed_on_to_ranks(shutdown_timeout_s, marks, nproc_per_node) as passed_on:
        try:
            # {rank: result}; ranks agree, rank 0 speaks
            result = elastic_launch(config, run_rank)(str(marks), os.getpid(), worker, *args)[0]
        except SignalException as stop:
            if passed_on.signum == signal.SIGINT or took_ctrl_c(marks):  # the ranks ended at once, or were ended
                raise Interrupted(signal.SIGINT, CTRL_C) from None
            if passed_on.cut_short:  # a rank stopped, or ended, before its training: no checkpoint came of it
                raise Interrupted(
                    passed_on.signum,
                    f"while the ranks were starting, before training, without a checkpoint ({passed_on.cut_short}; "
                    "the others were ended)",
                ) from None
            if passed_on.signum:  # the ranks had not ended parallel.shutdown_timeout_s after it: killed
                raise Interrupted(
                    passed_on.signum,
                    f"(passed on to the ranks, which had not stopped {shutdown_timeout_s:g} s later, "
                    "parallel.shutdown_timeout_s, and were killed: see train.log for their last checkpoint)",
                ) from None
            if stop.sigval in PASSED_ON:  # no rank to pass it on to: none started yet (or all ended)
                raise Interrupted(stop.sigval, "while no rank was running, without a checkpoint") from None
            raise Interrupted(stop.sigval, "(no checkpoint)") from None  # SIGHUP, SIGQUIT
        except ChildFailedError as failed:
            rank, failure = _first_failure(failed)
            if passed_on.signum == signal.SIGINT or took_ctrl_c(marks):  # a rank not yet listening, or a peer's end
                raise Interrupted(signal.SIGINT, CTRL_C) from None
            if (signum := passed_on.signum or -failure.exitcode) in PASSED_ON and failure.exitcode == -signum:
                # A rank still starting, not yet listening, ended by the signal passed on or by one sent to it alone.
                where = f"while the ranks were starting, before training, without a checkpoint (rank {rank} ended)"
                raise Interrupted(signum, where) from None
            message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
            if str(message).startswith("ConfigError: "):  # bad input only a rank could see, e.g. in a data file
                raise ConfigError(str(message).removeprefix("ConfigError: ")) from None
            if str(message).startswith("StorageError: "):  # rank 0's failed write: its own line and exit code
                raise StorageError(str(message).removeprefix("StorageError: ")) from None
            raise WorkerFailed(f"rank {rank} failed (exit code {failure.exitcode}): {message}") from None
        if isinstance(result, Stopped):
            raise Interrupted(result.signum, result.where)
    return result


def _first_failure(failed: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed first, whose error made the others' collectives fail (closed connections).

    The agent reports the first dead process it finds, but the others follow within milliseconds, and when several
    are gone by its next look it names the lowest rank. A rank a signal ended (the OOM killer's SIGKILL) is the
    cause of the others' failed collectives, not their consequence. Else every rank that raised wrote an error file
    beside the reported one (`attempt_N/<local rank>/error.json`; on one node local rank is rank): the earliest
    names the rank that failed first.
    """
    killed = sorted(rank for rank, failure in failed.failures.items() if failure.exitcode < 0)
    if killed:
        return killed[0], failed.failures[killed[0]]
    rank, failure = failed.get_first_failure()
    if not os.path.isfile(failure.error_file):
        return rank, failure
    written = {path.parent.name: path for path in Path(failure.error_file).parent.parent.glob("*/error.json")}
    first = min(written, key=lambda name: written[name].stat().st_mtime_ns)
    if not first.isdigit() or int(first) == rank:
        return rank, failure
    # A rank that raised exits with 1 (torch's worker wrapper); its pid is not needed here.
    return int(first), ProcessFailure(local_rank=int(first), pid=0, exitcode=1, error_file=str(written[first]))


def run_rank(stop_marks: str, launcher: int, worker: Callable[..., T], *args) -> T | Stopped:
    """A rank: `worker(*args)`. Before and after the training loop's own handling of stop signals
    (hydraloop.preemption.StopRequest), one ends the rank through Interrupted too (stop_at_once), not by the signal's
    default, which the agent would take for a failed rank; one before its training is marked in `stop_marks` for the
    launcher (hydraloop.parallel.rank_stops)."""
    if _forked_by == os.getppid():
        _start_as_a_spawned_rank()
    _temporary_files_in(Path(stop_marks).parent)
    loops_before = loops_entered()
    signal.signal(signal.SIGINT, functools.partial(interrupt_rank, stop_marks))
    with stop_at_once():
        try:
            result = worker(*args)
        except Interrupted as stop:
            stop_taken()
            result = Stopped(stop.signum, str(stop).removeprefix(f"stopped by {signal.Signals(stop.signum).name} "))
            if loops_entered() == loops_before:
                mark_stopped_alone(stop_marks, stop.signum, launcher)
        except KeyboardInterrupt:  # its peers may wait for it in a collective
            stop_taken()
            result = Stopped(signal.SIGINT, CTRL_C)
            mark_stopped_alone(stop_marks, signal.SIGINT, launcher)
        # The rank's work is done; a stop signal passed on from now (the launcher's comes asynchronously, and may
        # reach a rank that finished first) has nothing left to stop, while its default would end the process as a
        # failed rank as it hands its result to the agent.
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        return result


def _temporary_files_in(folder: Path) -> None:
    """This rank's temporary files (tempfile's, and TMPDIR for what it starts) in the launcher's `folder`, removed
    however the rank ended: a killed rank's pymp-* and W&B's media folders outlived it in the user's. torch's compile
    cache stays there (TORCHINDUCTOR_CACHE_DIR), for later runs. The loaders' fork server listens on a socket in the
    multiprocessing folder, whose path takes 107 characters at most: past that (a TMPDIR past 56 characters; 51
    failed with `AF_UNIX path too long`), the folder is made in the user's TMPDIR, as a single process makes it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # in the user's temporary folder
    if len(f"{folder}/pymp-12345678/listener-12345678") > SOCKET_PATH_MAX:
        multiprocessing.util.get_temp_dir()  # made once per process, and kept
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)


def _start_as_a_spawned_rank() -> None:
    """A forked rank holds its launcher's signal handlers: it gets the defaults a spawned rank starts with, which
    hydraloop.preemption builds on. It holds its launcher's exit handlers too, most of them registered as modules were
    imported (torch's, a user's module's), as a spawned rank registers them: they run at its exit, with its own (a
    logger's last row and status on failure, the process group's teardown). A forked process ends with os._exit,
    which skips atexit; multiprocessing runs its own finalizers then, after torch has recorded the rank's result or
    error, and one of them now runs atexit's handlers (through a private function: the module has no public one).
    The launcher's weakref finalizers are its own objects' (a temporary folder) and stay its own, as does the agent's
    temporary folder: tempfile's is the launcher's usual one again."""
    tempfile.tempdir = _tempdir
    for sig in (*STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False
    multiprocessing.util.Finalize(None, atexit._run_exitfuncs, exitpriority=0)
    # torch replaces the thread pool a fork copied (its threads are gone) at the pool's first use after the fork, and
    # a second thread using it meanwhile finds none: autograd's threads, starting together at the first backward
    # pass, abort the rank ("Invalid thread pool!"). Its first use is here, on this one thread.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Leaking Caffe2 thread-pool after fork")  # what it says it does
        torch.set_num_threads(torch.get_num_threads())
