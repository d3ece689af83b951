"""What rank 0 writes: logger runs, checkpoints, metrics.json, profiler traces, and the console progress bar.

Every other rank gets NullRunWriter, so the training loop calls the same methods on all ranks and never asks
"am I rank 0?". Every write is atomic and durable, and a failed one raises StorageError (hydraloop.storage).
"""

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hydraloop import sharded_checkpoint
from hydraloop.checkpoint import save_atomic, step_checkpoint, step_checkpoints
from hydraloop.console import progress_bar
from hydraloop.loggers import JobInfo, NullLogger, RunInfo
from hydraloop.profiling import NullProfiler, step_profiler
from hydraloop.sharded_checkpoint import WrittenShards
from hydraloop.storage import link_atomic, remove, storage_errors, symlink_atomic, write_atomic

KEPT = "; the checkpoints saved before are intact"


class NullRunWriter:
    def progress(self, total_steps: int, done_steps: int) -> AbstractContextManager[tqdm]:
        return progress_bar(total_steps, done_steps, enabled=False)

    def profiler(self) -> AbstractContextManager:
        return NullProfiler()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def save_checkpoint(self, make_state: Callable[[], dict[str, Any]], is_best: bool) -> None:
        pass

    def checkpoint_written(self) -> None:
        pass

    def interrupted(self, signum: int) -> None:
        pass

    def finish(self, metrics: dict[str, Any]) -> None:
        pass


class RunWriter(NullRunWriter):
    def __init__(
        self,
        run_dir: str | Path,
        logger: NullLogger,
        config: dict[str, Any],
        save_checkpoints: bool,
        profile: bool,
        keep_last_k: int = 2,
        start_step: int = 0,
        num_params: int = 0,
        job: JobInfo | None = None,
        val_metrics: tuple[str, ...] = (),
    ) -> None:
        """`keep_last_k`: step-named checkpoints kept beside last.pt; `start_step`: the step this run resumed from
        (0: from scratch), which separates this run's line of checkpoints from one it abandoned (see
        `_keep_last_k`); `num_params`: the model's parameter count; `job`: the Hydra job's overrides and multirun,
        if any; `val_metrics`: the names of the task's validation metrics."""
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.logger = logger
        self.save_checkpoints = save_checkpoints
        self.profile = profile
        self.keep_last_k = keep_last_k
        self.start_step = start_step
        self.saved_steps: set[int] = set()
        self.pending: tuple[dict[str, Any], bool] | None = None  # a sharded checkpoint still being written
        for staging in self.checkpoint_dir.glob("*.tmp"):  # a crash's unfinished write: never a checkpoint
            shutil.rmtree(staging) if staging.is_dir() and not staging.is_symlink() else staging.unlink()
        with self._logger_errors():
            logger.start(RunInfo(self.run_dir, config, num_params, job or JobInfo(), tuple(val_metrics), start_step))

    def progress(self, total_steps: int, done_steps: int) -> AbstractContextManager[tqdm]:
        return progress_bar(total_steps, done_steps)

    def profiler(self) -> AbstractContextManager:
        return step_profiler(self.run_dir / "tensorboard" / "profiler") if self.profile else NullProfiler()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self._logger_errors():
            self.logger.log_metrics(metrics, step)
        if self.pending and self.pending[0]["model"].future.done():  # written in the background meanwhile
            self.checkpoint_written()

    def save_checkpoint(self, make_state: Callable[[], dict[str, Any]], is_best: bool) -> None:
        """checkpoints/step-<global step>.pt, and last.pt as a second name of it (a hard link: no extra write or
        space); best.pt a third when the optimized metric improved. Then only the newest `keep_last_k` step-named
        ones stay. A write that fails leaves last.pt and best.pt as they were."""
        if not self.save_checkpoints:
            return
        self.checkpoint_written()
        with self._logger_errors():
            self.logger.flush()  # every record up to this checkpoint is on disk before it is
        state = make_state()
        if isinstance(state["model"], WrittenShards):  # each rank writes its own (hydraloop.sharded_checkpoint)
            self.pending = (state, is_best)
            if state["model"].future is None:
                self.checkpoint_written()
            return
        saved = step_checkpoint(self.checkpoint_dir, state["global_step"])
        save_atomic(state, saved, KEPT)
        self._name(saved, is_best, link_atomic)

    def checkpoint_written(self) -> None:
        """A sharded checkpoint, once every rank's shards are on disk: the rest of it written beside them, the
        directory renamed from its staging name, and named last.pt (best.pt) by a symbolic link."""
        if self.pending is None:
            return
        (state, is_best), self.pending = self.pending, None
        state["model"].wait(KEPT)
        saved = step_checkpoint(self.checkpoint_dir, state["global_step"])
        sharded_checkpoint.finish(state, saved, KEPT)
        self._name(saved, is_best, symlink_atomic)

    def _name(self, saved: Path, is_best: bool, link: Callable[[Path, Path, str], None]) -> None:
        self.saved_steps.add(int(saved.stem.removeprefix("step-")))
        link(saved, self.checkpoint_dir / "last.pt", KEPT)
        if is_best:
            link(saved, self.checkpoint_dir / "best.pt", KEPT)
        self._keep_last_k()

    def _keep_last_k(self) -> None:
        """Removes all but the newest `keep_last_k` step-named checkpoints of this run's line: those this run saved
        and those up to the step it resumed from. Newer ones belong to a line it abandoned (resume=false, or a last.pt
        that could not be read): they go too, so that "newest" always means this line's newest. The data of a removed
        one that is still last.pt or best.pt stays under that name: a file's by its hard link; a sharded
        checkpoint's directory, which last.pt or best.pt links to by name, stays."""
        found = step_checkpoints(self.checkpoint_dir)
        line = sorted(step for step in found if step <= self.start_step or step in self.saved_steps)
        linked = {(self.checkpoint_dir / name).resolve() for name in ("last.pt", "best.pt")}
        for step in found.keys() - set(line[-self.keep_last_k :]):
            if found[step].is_dir():
                if found[step].resolve() not in linked:
                    with storage_errors(found[step]):
                        shutil.rmtree(found[step])
            else:
                remove(found[step])

    def interrupted(self, signum: int) -> None:
        """The stop signal `signum` ends the run after its checkpoint: the loggers mark their runs preempted."""
        with self._logger_errors():
            self.logger.interrupted(signum)

    def finish(self, metrics: dict[str, Any]) -> None:
        """Final metrics: to the loggers, and as metrics.json (written atomically)."""
        self.checkpoint_written()
        with self._logger_errors():
            self.logger.finish(metrics)
        text = json.dumps(metrics, indent=2) + "\n"
        write_atomic(self.run_dir / "metrics.json", lambda file: file.write(text.encode()))

    @contextmanager
    def _logger_errors(self) -> Iterator[None]:
        """A logger's failed write (its own files, under the run directory) as StorageError."""
        with storage_errors(self.run_dir):
            yield


@contextmanager
def loggers_ended_on_ctrl_c(writer: NullRunWriter) -> Iterator[None]:
    """Ctrl-C (KeyboardInterrupt) ends the loggers' runs where it comes, not at the process's exit, which a rank is
    not sure to reach: the launcher of ranks kills them all once rank 0 has handed its stop in and a peer is still
    waiting in C++ (hydraloop.parallel.rank_stops)."""
    try:
        yield
    except KeyboardInterrupt:
        writer.interrupted(signal.SIGINT)
        raise
