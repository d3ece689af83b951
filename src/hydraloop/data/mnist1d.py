import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydraloop"


def load_mnist1d(cache_dir: str | None = None) -> tuple[TensorDataset, TensorDataset]:
    """MNIST-1D with the package's default generation arguments: 4000 train / 1000 test, shape (1, 40)."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / "mnist1d_default.npz"
    if not path.exists():
        _generate(path)
    arrays = np.load(path)

    def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.tensor(x, dtype=torch.float32).unsqueeze(1), torch.tensor(y, dtype=torch.long))

    return tensors(arrays["x"], arrays["y"]), tensors(arrays["x_test"], arrays["y_test"])


def _generate(path: Path) -> None:
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds numpy's and Python's global RNGs; keep the caller's streams untouched.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Ranks may generate at once: each writes its own temporary file, and the rename is atomic.
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **{k: data[k] for k in ("x", "y", "x_test", "y_test")})
    os.replace(tmp, path)
