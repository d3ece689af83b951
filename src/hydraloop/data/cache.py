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


def unwritable_cache(cache_dir: str | None, reason: str) -> str:
    """The one line for a cache folder that cannot be written, naming what set it: the key, or the environment
    variable its default comes from."""
    if cache_dir:
        return f"data.dataset.cache_dir={cache_dir}: cannot be written: {reason}"
    folder = default_cache_dir()
    if os.environ.get("XDG_CACHE_HOME"):
        return (
            f"XDG_CACHE_HOME={os.environ['XDG_CACHE_HOME']}: the data cache under it, {folder}, cannot be written: "
            f"{reason} (data.dataset.cache_dir=... puts it elsewhere)"
        )
    return f"data.dataset.cache_dir=null: the default, {folder}, cannot be written: {reason}"


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
            raise ConfigError(unwritable_cache(cache_dir, describe(error))) from None
    with np.load(path) as arrays:
        return dict(arrays)
