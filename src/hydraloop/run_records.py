"""A refused command leaves the run directory as it was: a new directory is removed, an existing one keeps every
file, byte for byte, with its times. Nothing is written into it before the launcher has accepted the run, and what
`accept` writes is put back if the run is refused (or stopped) before it has written a record of its own.

Hydra would write `.hydra/` (the composed config, its own config, the overrides) before `main` runs, and open the
job log at the first line logged. Here Hydra writes no `.hydra/` (`hydra.output_subdir: null` in conf/train.yaml;
the command line may not set it, hydraloop.checks.command_line), and the job log's lines are held in memory: once every
check has passed, `accept` writes `.hydra/` and the held lines; a refusal drops them (the console has shown them).

The launcher checks all that the config and the environment can tell. What only the ranks meet before the first
step (an image folder's size, which the launcher does not count, against a warm-up in epochs) and a stop signal
there end the run after `accept`: if by then the run has written nothing but `.hydra/` and its job log, `undo` puts
`.hydra/` back as it was and cuts the job log back to where it ended.
"""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hydraloop.errors import ConfigError, Interrupted, unwrap_instantiation
from hydraloop.storage import write_atomic

HYDRA_SUBDIR = ".hydra"
# The folders above the run (or sweep) directory that did not exist before Hydra made it, deepest first: a refused
# run removes them too, where empty (outputs/<date>/ of a first run of the day, say).
_new_parents: list[Path] = []


def note_new_parents(folder: str | Path) -> None:
    """Called before Hydra makes `folder`: which of its parents it will make."""
    _new_parents[:] = [parent for parent in Path(folder).absolute().parents if not parent.exists()]


class _Held(logging.Filter):
    """Keeps the records a handler is given instead of letting it write them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


class HeldRecords:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(os.path.abspath(run_dir))  # as a FileHandler names its file
        self.accepted = False
        self.before: _Before | None = None  # what the directory held when `accept` wrote into it
        self.held = [
            (handler, _Held())
            for handler in logging.getLogger().handlers
            if isinstance(handler, logging.FileHandler) and _inside(handler.baseFilename, self.run_dir)
        ]
        for handler, held in self.held:
            handler.addFilter(held)

    def accept(self, config: Any, write_config: bool) -> None:
        """The run goes ahead: `.hydra/` (if `write_config`: the run directory's owner) and the held log lines."""
        if write_config:
            from hydra.core.hydra_config import HydraConfig

            folder = self.run_dir / HYDRA_SUBDIR
            files = {"config.yaml": config}
            if HydraConfig.initialized():
                files |= {"hydra.yaml": HydraConfig.instance().cfg, "overrides.yaml": HydraConfig.get().overrides.task}
            logs = [Path(handler.baseFilename) for handler, _ in self.held]
            self.before = _Before.of(self.run_dir, [folder / name for name in files], logs)
            for name, node in files.items():
                text = OmegaConf.to_yaml(node)
                write_atomic(folder / name, lambda file, text=text: file.write(text.encode()))
        for handler, held in self.held:
            handler.removeFilter(held)
            for record in held.records:
                handler.handle(record)
        self.accepted = True

    def drop(self) -> None:
        """The run was refused, or has nothing to do: its held lines are dropped (the console has shown them), and
        a run directory left empty is removed."""
        self._close_job_log()
        self._remove_if_empty()

    def undo(self) -> bool:
        """The accepted run was refused or stopped: if it has written nothing but what `accept` wrote and job-log
        lines, `.hydra/` is put back as it was (bytes and times), the job log cut back to its length then, and the
        job log closed (the console shows the rest). False, and nothing done, once the run has written a record of
        its own: the directory is that run's, and its job log says how it ended."""
        before = self.before
        if before is None or before.others() != before.files:
            return False
        self._close_job_log()
        before.restore()
        self._remove_if_empty()
        return True

    def _close_job_log(self) -> None:
        for handler, held in self.held:
            handler.removeFilter(held)
            logging.getLogger().removeHandler(handler)
            handler.close()  # a delayed FileHandler that never wrote has made no file

    def _remove_if_empty(self) -> None:
        for folder in (self.run_dir, *_new_parents):
            with suppress(OSError):
                folder.rmdir()  # only if empty


@dataclass
class _Before:
    """A run directory as `accept` found it: what `accept` and the job log change in it, and every other file."""

    run_dir: Path
    records: dict[Path, tuple[bytes, int, int] | None]
    """`.hydra/`'s files, which `accept` replaces: (bytes, access and modification times in ns); None: absent."""
    logs: dict[Path, tuple[int, int, int] | None]
    """The job logs, which only grow: (size, access and modification times in ns); None: absent."""
    files: dict[Path, tuple[int, int, int]] = field(init=False)
    """Every other file: (inode, size, modification time), which a write changes."""

    def __post_init__(self) -> None:
        self.files = self.others()

    @classmethod
    def of(cls, run_dir: Path, records: list[Path], logs: list[Path]) -> "_Before":
        stats = {path: path.stat() if path.is_file() else None for path in (*records, *logs)}  # before reading them
        kept = {path: stats[path] and (path.read_bytes(), *_times(stats[path])) for path in records}
        return cls(run_dir, kept, {path: stats[path] and (stats[path].st_size, *_times(stats[path])) for path in logs})

    def others(self) -> dict[Path, tuple[int, int, int]]:
        """Every file under the run directory but `.hydra/`'s, the job logs and the lock (taken before `accept`,
        released before `undo`): (inode, size, modification time)."""
        from hydraloop.run_lock import LOCK_FILE

        leave_out = {*self.records, *self.logs, self.run_dir / LOCK_FILE}
        leave_out |= {path.with_name(path.name + ".tmp") for path in self.records}  # write_atomic's, while it writes
        return _files(self.run_dir, leave_out)

    def restore(self) -> None:
        for path, saved in self.records.items():
            if saved is None:
                path.unlink(missing_ok=True)
            else:
                content, *times = saved
                write_atomic(path, lambda file, content=content: file.write(content))
                os.utime(path, ns=tuple(times))
        for path, saved in self.logs.items():
            if saved is None:
                path.unlink(missing_ok=True)
            else:
                size, *times = saved
                os.truncate(path, size)
                os.utime(path, ns=tuple(times))
        if all(saved is None for saved in self.records.values()):  # `accept` made `.hydra/`
            for folder in {path.parent for path in self.records}:
                with suppress(OSError):
                    folder.rmdir()


def _times(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_atime_ns, stat.st_mtime_ns


def _files(folder: Path, leave_out: set[Path]) -> dict[Path, tuple[int, int, int]]:
    """(inode, size, modification time) of every file and link under `folder`, but those in `leave_out`."""
    found = {}
    for root, folders, names in os.walk(folder):  # links to folders are listed, not followed
        for name in (*names, *(name for name in folders if os.path.islink(os.path.join(root, name)))):
            path = Path(root, name)
            if path not in leave_out:
                stat = path.lstat()
                found[path] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found


@contextmanager
def held_until_accepted(run_dir: str | Path) -> Iterator[HeldRecords]:
    """The run directory's records, held back (see the module docstring): an exception before `accept` drops them,
    a refusal or stop after it undoes what `accept` wrote, unless the run has written records of its own."""
    records = HeldRecords(run_dir)
    try:
        yield records
    except BaseException as error:
        if not records.accepted:
            records.drop()
        elif isinstance(unwrap_instantiation(error), (ConfigError, Interrupted)):  # a refusal or a stop, not a failure
            records.undo()
        raise


def holds_training_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a training run's records, or is inside a training run's directory (its
    `checkpoints/`, say): checkpoints, or the config of a run with mode=train."""
    for folder in (Path(run_dir), *Path(run_dir).resolve().parents[:2]):
        config = folder / HYDRA_SUBDIR / "config.yaml"
        if any(folder.glob("checkpoints/*.pt")) or any(folder.glob("step-*.pt")) or (folder / "last.pt").is_file():
            return True
        if config.is_file() and OmegaConf.load(config).get("mode", "train") == "train":
            return True
    return False


def _inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())
