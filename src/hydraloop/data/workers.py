"""The processes behind a loader with workers (hydraloop.data.loaders): a fork server per rank that has imported the
entrypoint, workers forked from it that are seeded and end with the rank however it ends, and the resource tracker.

A stop signal is the rank's to take (hydraloop.preemption): it checkpoints where the ranks next meet, and needs its
workers' batches until then. A scheduler may send it to every process of the job by pid (SLURM signals each process
of a job step: scancel, its time limit, the `--signal` that submitit requeues on; so does `pkill`). It ended the
workers, and the rank failed where it would have written its checkpoint (exit 1: `DataLoader worker (pid(s) ...)
exited unexpectedly`); SIGUSR1 ended the resource tracker, whose successor printed a KeyError traceback for each
shared-memory segment the first had registered. So these processes ignore the stop signals (SIGINT too: the rank's
Ctrl-C ends it at once, and them with it). The rank ends its workers itself as it exits (`_end_workers`): they
ignore the SIGTERM that multiprocessing would send them before waiting for them.
"""

import contextlib
import gc
import json
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import random
import select
import signal
import sys
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from hydraloop.data import forkserver_main
from hydraloop.data.seeded_augmentation import SeededAugmentation
from hydraloop.preemption import STOP_SIGNALS

IGNORED = (*STOP_SIGNALS, signal.SIGINT)
_ending_registered = False


class LoaderWorker(multiprocessing.context.ForkServerProcess):
    """A loader's worker, forked from the fork server. It ignores SIGTERM, so it is ended by SIGKILL: by torch's
    loader, where the worker has not ended 5 s after its shutdown request (it lived on, with its fork server, in a
    process that outlives its runs: a joblib sweep's worker), and by this process at its exit (`_end_workers`)."""

    def terminate(self) -> None:
        self.kill()


class _LoaderContext(multiprocessing.context.ForkServerContext):
    Process = LoaderWorker


LOADER_CONTEXT = _LoaderContext()
"""The loaders' `multiprocessing_context` (with workers): the fork server's, its processes LoaderWorkers."""


def start_worker(owner: int, worker_id: int) -> None:
    """A loader's worker starts (its `worker_init_fn`): it ignores the stop signals, ends with the process that owns
    the loader (`owner`), and is seeded."""
    for sig in IGNORED:  # torch's worker set its own SIGTERM handler: it ended the worker on a signal from elsewhere
        signal.signal(sig, signal.SIG_IGN)
    _end_with(owner)
    # torch seeds each worker from the loader's generator; derive numpy's and Python's seeds from it too.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    # What the worker holds by now (torch, the data set) lives as long as it does: out of the collector's way, as
    # src/train.py does for its own imports; each full collection would otherwise re-scan it.
    gc.freeze()


def start_fork_server(*datasets: Dataset) -> None:
    """Starts this process's fork server (see hydraloop.data.loaders.build_loaders) now, while the rank sets up the
    rest, having it import the entrypoint (hydraloop.data.forkserver_main) and the data sets' modules, torch and
    torchvision among them, before it forks any worker: each worker would otherwise import them itself, seconds of CPU
    apiece. The stop signals are blocked while it starts, until forkserver_main ignores them."""
    modules = {type(dataset).__module__ for dataset in datasets}
    modules |= {type(dataset.dataset).__module__ for dataset in datasets if isinstance(dataset, SeededAugmentation)}
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    # `python -m module`: the workers import it by its name (multiprocessing leaves a package's __main__ alone).
    by_name = spec is not None and bool(spec.name)
    entrypoint = [spec.name] if by_name and not spec.name.endswith("__main__") else []
    preload = ["hydraloop.data.forkserver_main", "__main__", *entrypoint, *sorted(modules - {"__main__"})]
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    given = {"sys_path": sys.path, "main_path": None if by_name else getattr(main, "__file__", None)}
    os.environ[forkserver_main.ENV] = json.dumps(given)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)  # inherited by what starts now
    try:
        start_resource_tracker()
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.environ.pop(forkserver_main.ENV, None)
    global _ending_registered
    if not _ending_registered:  # before multiprocessing's own exit handling, which would terminate and join them
        multiprocessing.util.Finalize(None, _end_workers, exitpriority=0)
        _ending_registered = True


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker, unless it runs, started with the stop signals blocked: it unblocks the two
    it ignores (SIGINT, SIGTERM), and SIGUSR1 and SIGUSR2 stay blocked there. Processes this one starts use it too."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _end_workers() -> None:
    """At this process's exit: its loaders' workers still running, which ignore the SIGTERM of multiprocessing's exit
    handler (it joins them after it), are killed (as that SIGTERM did: they hold nothing to save)."""
    for process in multiprocessing.active_children():
        if isinstance(process, LoaderWorker) and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(process.pid, signal.SIGKILL)


def _end_with(owner: int) -> None:
    """Ends this worker as soon as the process `owner` has ended. torch's workers watch their parent, which for a
    worker forked from the fork server is that server, not the loader's owner; and the server lives as long as a
    worker holds its pipe (as does multiprocessing's resource tracker): a killed rank (SIGKILL, the out-of-memory
    killer, the launcher ending the ranks) left its workers, its server and its resource tracker running for good."""
    try:
        owner_fd = os.pidfd_open(owner)
    except ProcessLookupError:  # ended already
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): polled instead
        owner_fd = None

    def wait() -> None:
        if owner_fd is not None:
            select.select([owner_fd], [], [])
        else:
            while _alive(owner):
                time.sleep(1)
        os._exit(1)

    threading.Thread(target=wait, name="hydraloop-owner-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
