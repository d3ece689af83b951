"""Writing into the run directory so that a crash, a power loss or a full disk loses nothing saved before.

Every file is written beside its final name (`NAME.tmp`), flushed and fsync'ed, renamed over the final name, and
then the directory is fsync'ed, so that the rename itself is on disk: once a file is saved, a machine that loses power
still has it, and until then the previous file of that name is untouched. A write that fails (no space left, quota,
permission, read-only file system, file-size limit) removes its temporary file and raises StorageError: one line
naming the path and the cause.
"""

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from hydraloop.errors import ConfigError, StorageError


def write_atomic(path: Path, write: Callable[[BinaryIO], object], consequence: str = "") -> None:
    """`write(file)` into `path`, atomically and durably (see the module docstring). `consequence` ends the error
    message (what the failure leaves as it was)."""
    tmp = path.with_name(path.name + ".tmp")
    with storage_errors(path, consequence):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as file:
                write(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
        fsync_directory(path.parent)


def link_atomic(source: Path, path: Path, consequence: str = "") -> None:
    """Makes `path` a second name of the file `source`, atomically: a hard link, which costs no space and no write,
    or, where the file system has no hard links, a durable copy."""
    tmp = path.with_name(path.name + ".tmp")
    with storage_errors(path, consequence):
        _remove_quietly(tmp)  # left by a crash between link and rename
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (or a fault, which the copy meets and reports)
            with open(source, "rb") as original:
                write_atomic(path, lambda file: shutil.copyfileobj(original, file), consequence)
            return
        _rename_into_place(tmp, path)


def symlink_atomic(target: Path, path: Path, consequence: str = "") -> None:
    """Makes `path` a symbolic link to `target` (by its name: both in one folder), replacing what `path` was in one
    rename: a directory has no hard links."""
    tmp = path.with_name(path.name + ".tmp")
    with storage_errors(path, consequence):
        _remove_quietly(tmp)
        os.symlink(target.name, tmp)
        _rename_into_place(tmp, path)


def _rename_into_place(tmp: Path, path: Path) -> None:
    """`tmp` renamed over `path`, and the rename put on disk; `tmp` removed if the rename fails."""
    try:
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_directory(path.parent)


def remove(path: Path, consequence: str = "") -> None:
    with storage_errors(path, consequence):
        path.unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    """Puts the renames in `directory` on disk. A file system that cannot fsync a directory (EINVAL) keeps them as
    durably as it keeps anything."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def check_writable(directory: Path, names: str = "run directory") -> None:
    """Bad input (exit 2) unless a file can be created in `directory`. Tried for real: permissions, a read-only
    mount and an immutable directory all refuse a new file, while os.access, for root, sees only the mount."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"{names} {directory}: cannot be written: {describe(error)}") from None


def check_makeable(folder: Path, names: str) -> None:
    """Bad input (exit 2) unless `folder` exists or can be made, and files can be written in it: whatever of its
    path exists is a folder, and its nearest existing ancestor takes a new file (tried for real, as above)."""
    folder = Path(folder)
    existing = next(path for path in (folder, *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"{names} {folder}: {existing} is a file, not a folder")
    check_writable(existing, names if existing == folder else f"{names} {folder}: the folder")


def check_appendable(path: Path, names: str) -> None:
    """Bad input (exit 2) unless the existing file `path` can be appended to; a missing one passes (and is not
    made: a run refused later leaves no empty job log behind)."""
    if not path.exists():
        return
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        raise ConfigError(f"{names} {path}: cannot be written: {describe(error)}") from None


@contextmanager
def storage_errors(path: Path, consequence: str = "") -> Iterator[None]:
    """Turns a failed write into StorageError naming `path` and the operating system's reason. torch.save reports
    a failed write of its file object as a RuntimeError ("enforce fail at inline_container.cc"), with the OSError
    among its causes: that is the reason given."""
    try:
        yield
    except StorageError:
        raise
    except Exception as error:
        cause = os_error_in(error)
        if cause is None:
            raise
        raise StorageError(f"cannot write {path}: {describe(cause)}{consequence}") from error


def describe(error: OSError) -> str:
    """`No space left on device (ENOSPC)`: the reason, and the errno name to search for."""
    if error.errno is None:
        return str(error)
    return f"{error.strerror or os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})"


def os_error_in(error: BaseException | None) -> OSError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _remove_quietly(path: Path) -> None:
    # A temporary file that cannot be removed was never written (a read-only directory refuses both).
    with suppress(OSError):
        path.unlink(missing_ok=True)
