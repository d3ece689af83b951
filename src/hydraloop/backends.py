"""Process-wide PyTorch switches, set once per rank before building: kernels that trade reproducibility for speed,
and the threads the rank computes with on the CPU."""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def configure_backends(*, deterministic: bool, tf32: bool, cudnn_benchmark: bool, cpu_threads: int | None) -> None:
    if cpu_threads:  # else PyTorch's default, or the share of the machine's cores a ddp/fsdp rank took in setup
        torch.set_num_threads(cpu_threads)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark and not deterministic
    if deterministic:  # only when asked: the call itself costs ~1 s of imports
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
        torch.use_deterministic_algorithms(True)


@contextmanager
def one_thread() -> Iterator[None]:
    """Computations too small to need a pool of threads: the launcher's checks. torch's first op on several threads
    starts an OpenMP pool that stays, and a process holding one cannot fork its ranks (parallel.start_method=auto):
    a forked child's first parallel region would wait forever on threads it does not have."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
