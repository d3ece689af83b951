"""Process-wide PyTorch switches that trade reproducibility for speed, set once per rank before building."""

import os

import torch


def configure_backends(*, deterministic: bool, tf32: bool, cudnn_benchmark: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark and not deterministic
    if deterministic:  # only when asked: the call itself costs ~1 s of imports
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
        torch.use_deterministic_algorithms(True)
