"""How pytest-xdist workers share the machine (conftest.py calls this as it is imported)."""

import os

import torch


def share_the_cores_between_test_workers() -> None:
    """Under pytest-xdist, each worker and the processes it starts compute with its share of the cores. PyTorch's
    default, a thread per core in every process, oversubscribes them, and its OpenMP threads then spin at each barrier
    waiting for a thread that is not scheduled: two recipes side by side took 99 s instead of 19 (2 cores,
    2026-12-05). A share set by the caller (OMP_NUM_THREADS) is kept; so are the tests that set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)  # for the processes tests start (train_env copies os.environ)
        torch.set_num_threads(share)  # this process read the variable when it imported torch
