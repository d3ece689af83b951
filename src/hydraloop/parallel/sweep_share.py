"""Parallel sweeps on one machine: `python src/train.py -m hydra/launcher=joblib hydra.launcher.n_jobs=N ...`.

Hydra's joblib launcher runs the sweep's jobs in N worker processes at once (joblib's loky backend). Left alone,
every job would see all GPUs and all cores: N jobs would pile onto GPU 0, and N x (threads per job) would fight
over the cores. So each worker process takes one of N slots, and with it one N-th of the machine: its own GPUs
(CUDA_VISIBLE_DEVICES) and its own cores (the CPU affinity, which the ranks it starts inherit; DDPStrategy gives
each rank its part of them). A worker keeps its slot for every job it runs, because CUDA reads
CUDA_VISIBLE_DEVICES once per process. Slots are claimed with file locks in `<sweep dir>/.slots/`: at most N jobs
run at once, so one is always free, and a lock goes with the process that held it.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hydraloop.errors import ConfigError

JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
THREAD_LIMITS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Set by joblib in its workers to cores / N; the share's affinity says the same per job, and DDP divides it."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    slot: int
    n_jobs: int
    cpus: tuple[int, ...]
    gpus: tuple[str, ...] | None  # None: a machine without GPUs
    lock: IO | None  # held open: the slot is this process's as long as it lives


_share: Share | None = None


def take_machine_share() -> Share | None:
    """Under hydra/launcher=joblib, confines this process (and the ranks it starts) to its slot's GPUs and cores;
    elsewhere does nothing and returns None. Must run before anything asks CUDA about devices."""
    global _share
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or HydraConfig.get().launcher.get("_target_") != JOBLIB_LAUNCHER:
        return None
    hydra = HydraConfig.get()
    if _share is None:
        n_jobs = _effective_n_jobs(hydra.launcher.n_jobs)
        slot, lock = _claim_slot(Path(hydra.sweep.dir) / ".slots", n_jobs)
        _share = Share(slot, n_jobs, _cpus(slot, n_jobs), _gpus(slot, n_jobs), lock)
        if _share.gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_share.gpus)
        if hasattr(os, "sched_setaffinity"):  # Linux
            os.sched_setaffinity(0, _share.cpus)
        for name in THREAD_LIMITS:
            os.environ.pop(name, None)
        if multiprocessing.get_start_method(allow_none=True) == "loky":
            # loky makes itself the default start method in its workers, and a rank spawned from one is told to use
            # it too, which plain multiprocessing there cannot find ("cannot find context for 'loky'").
            multiprocessing.set_start_method("spawn", force=True)
    import torch

    torch.set_num_threads(len(_share.cpus))
    gpus = "no GPU" if _share.gpus is None else f"GPU(s) {','.join(_share.gpus)}"
    log.info(
        "parallel sweep: job %s in slot %d of %d: %s, CPU cores %s",
        hydra.job.num,
        _share.slot,
        _share.n_jobs,
        gpus,
        ",".join(map(str, _share.cpus)),
    )
    return _share


def _effective_n_jobs(n_jobs: int) -> int:
    """joblib's meaning: a positive number as it is, -1 all cores, -2 all but one, ..."""
    return n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)


def _claim_slot(folder: Path, n_jobs: int) -> tuple[int, IO | None]:
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(n_jobs):
        handle = (folder / f"{slot}.lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return slot, handle
    # More workers than slots: joblib respawned one whose predecessor has not exited yet. Share with someone.
    slot = os.getpid() % n_jobs
    log.warning("parallel sweep: all %d slots taken; sharing slot %d", n_jobs, slot)
    return slot, None


def _cpus(slot: int, n_jobs: int) -> tuple[int, ...]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < n_jobs:  # more jobs than cores: each gets one, shared with others
        return (cpus[slot % len(cpus)],)
    per_job = len(cpus) // n_jobs
    return tuple(cpus[slot * per_job : (slot + 1) * per_job])


def _gpus(slot: int, n_jobs: int) -> tuple[str, ...] | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [gpu.strip() for gpu in visible.split(",") if gpu.strip() and gpu.strip() != "-1"]
    else:
        import torch

        # NVML's count, which leaves CUDA uninitialised, so that the variable set after this still applies.
        gpus = [str(index) for index in range(torch.cuda.device_count())]
    if not gpus:
        return None
    if len(gpus) < n_jobs:
        raise ConfigError(
            f"hydra.launcher.n_jobs={n_jobs}: more jobs at once than the {len(gpus)} GPU(s) visible; each job needs "
            "at least one"
        )
    per_job = len(gpus) // n_jobs
    return tuple(gpus[slot * per_job : (slot + 1) * per_job])
