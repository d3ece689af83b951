"""Nothing is written into a run directory before the launcher has accepted the run: a refusal leaves a new
directory empty (and removes it) and an existing one as it was.

Hydra would write `.hydra/` (the composed config, its own config, the overrides) before `main` runs, and open the
job log at the first line logged. Here Hydra writes no `.hydra/` (`hydra.output_subdir: null` in conf/train.yaml),
and the job log's lines are held in memory: once every check has passed, `accept` writes `.hydra/` and the held
lines; a refusal drops them (the console has shown them).
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

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
        self.run_dir = Path(run_dir)
        self.accepted = False
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
        for handler, held in self.held:
            handler.removeFilter(held)
            logging.getLogger().removeHandler(handler)
            handler.close()  # a delayed FileHandler that never wrote has made no file
        for folder in (self.run_dir, *_new_parents):
            with suppress(OSError):
                folder.rmdir()  # only if empty


@contextmanager
def held_until_accepted(run_dir: str | Path) -> Iterator[HeldRecords]:
    """The run directory's records, held back (see the module docstring); an exception before `accept` drops them."""
    records = HeldRecords(run_dir)
    try:
        yield records
    except BaseException:
        if not records.accepted:
            records.drop()
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
