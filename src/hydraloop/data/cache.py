"""An on-disk cache of generated or converted arrays, so that later runs (and every rank) skip the work."""

import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import numpy as np

from hydraloop.errors import ConfigError
from hydraloop.storage import describe


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydraloop"


def cached_arrays(
    name: str, make: Callable[[], dict[str, np.ndarray]], cache_dir: str | None = None
) -> dict[str, np.ndarray]:
    """Loads `<cache_dir>/<name>.npz`, first writing it with `make()` if it is missing."""
    path = (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{name}.npz"
    if not path.exists():
        # Ranks may build it at once: each writes its own temporary file, and the rename is atomic.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, **make())
            os.replace(tmp, path)
        except OSError as error:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            where = cache_dir if cache_dir else f"null (the default, {path.parent})"
            raise ConfigError(f"data.dataset.cache_dir={where}: cannot be written: {describe(error)}") from None
    with np.load(path) as arrays:
        return dict(arrays)
