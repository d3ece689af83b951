"""What the rank-launch tests (test_rank_launch.py) run in their ranks, importable by module path as a spawned rank
imports its function."""

import atexit
import os
import signal
import time
from pathlib import Path

import torch


def deaf_rank_signalling_its_launcher() -> None:
    """A spawned rank (hydraloop.parallel.spawned_ranks.launch_ranks's worker) that cannot take a stop signal yet, as
    one still importing its modules: SIGTERM's default handler, then a SIGTERM to its launcher, which passes it on."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)


def deaf_rank_signalled_alone(signal_name: str) -> None:
    """The same rank, ended by a signal sent to it alone (`kill <its pid>`): its launcher never got one."""
    signal.signal(signal.Signals[signal_name], signal.SIG_DFL)
    os.kill(os.getpid(), signal.Signals[signal_name])


def exp_on_two_threads() -> str:
    """A rank's computation on two threads: in a rank forked from a process whose OpenMP pool had started, it would
    wait forever on the pool's threads."""
    torch.set_num_threads(2)
    torch.randn(10**7).exp_()
    return "computed"


def record_at_exit(record: str, fail_rank: int) -> str:
    """A rank that registers an exit handler writing its name into `record`; rank `fail_rank` then raises, while the
    others wait for it in a collective, which fails."""
    rank = int(os.environ["RANK"])

    def write() -> None:
        with Path(record).open("a") as file:
            file.write(f"rank{rank} ")

    atexit.register(write)
    torch.distributed.init_process_group("gloo")
    atexit.register(torch.distributed.destroy_process_group)
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} raised")
    torch.distributed.barrier()
    return "returned"
