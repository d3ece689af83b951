"""What rank 0 writes: logger runs, checkpoints, metrics.json, profiler traces, and the console progress bar.

Every other rank gets NullRunWriter, so the training loop calls the same methods on all ranks and never asks
"am I rank 0?". Every write is atomic and durable, and a failed one raises StorageError (hydraloop.storage).
"""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hydraloop.checkpoint import save_atomic, step_checkpoint, step_checkpoints
from hydraloop.console import progress_bar
from hydraloop.loggers import JobInfo, NullLogger, RunInfo
from hydraloop.profiling import NullProfiler, step_profiler
from hydraloop.storage import link_atomic, remove, storage_errors, write_atomic

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

    def interrupted(self) -> None:
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
        with self._logger_errors():
            logger.start(RunInfo(self.run_dir, config, num_params, job or JobInfo(), tuple(val_metrics), start_step))

    def progress(self, total_steps: int, done_steps: int) -> AbstractContextManager[tqdm]:
        return progress_bar(total_steps, done_steps)

    def profiler(self) -> AbstractContextManager:
        return step_profiler(self.run_dir / "tensorboard" / "profiler") if self.profile else NullProfiler()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self._logger_errors():
            self.logger.log_metrics(metrics, step)

    def save_checkpoint(self, make_state: Callable[[], dict[str, Any]], is_best: bool) -> None:
        """checkpoints/step-<global step>.pt, and last.pt as a second name of it (a hard link: no extra write or
        space); best.pt a third when the optimized metric improved. Then only the newest `keep_last_k` step-named
        ones stay. A write that fails leaves last.pt and best.pt as they were."""
        if not self.save_checkpoints:
            return
        with self._logger_errors():
            self.logger.flush()  # every record up to this checkpoint is on disk before it is
        state = make_state()
        step = state["global_step"]
        saved = step_checkpoint(self.checkpoint_dir, step)
        save_atomic(state, saved, KEPT)
        self.saved_steps.add(step)
        link_atomic(saved, self.checkpoint_dir / "last.pt", KEPT)
        if is_best:
            link_atomic(saved, self.checkpoint_dir / "best.pt", KEPT)
        self._keep_last_k()

    def _keep_last_k(self) -> None:
        """Removes all but the newest `keep_last_k` step-named checkpoints of this run's line: those this run saved
        and those up to the step it resumed from. Newer ones belong to a line it abandoned (resume=false, or a last.pt
        that could not be read): they go too, so that "newest" always means this line's newest. The data of a removed
        one that is still last.pt or best.pt stays under that name."""
        found = step_checkpoints(self.checkpoint_dir)
        line = sorted(step for step in found if step <= self.start_step or step in self.saved_steps)
        for step in found.keys() - set(line[-self.keep_last_k :]):
            remove(found[step])

    def interrupted(self) -> None:
        """A stop signal ends the run after its checkpoint: the loggers mark their runs preempted."""
        with self._logger_errors():
            self.logger.interrupted()

    def finish(self, metrics: dict[str, Any]) -> None:
        """Final metrics: to the loggers, and as metrics.json (written atomically)."""
        with self._logger_errors():
            self.logger.finish(metrics)
        text = json.dumps(metrics, indent=2) + "\n"
        write_atomic(self.run_dir / "metrics.json", lambda file: file.write(text.encode()))

    @contextmanager
    def _logger_errors(self) -> Iterator[None]:
        """A logger's failed write (its own files, under the run directory) as StorageError."""
        with storage_errors(self.run_dir):
            yield
