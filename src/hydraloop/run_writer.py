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

    def finish(self, metrics: dict[str, Any]) -> None:
        """Final metrics: to the loggers, and as metrics.json (written atomically)."""
        metrics = {**metrics, "model/params": self.num_params}
        with self._logger_errors():
            self.logger.finish(metrics)
        text = json.dumps(metrics, indent=2) + "\n"
        write_atomic(self.run_dir / "metrics.json", lambda file: file.write(text.encode()))

    @contextmanager
    def _logger_errors(self) -> Iterator[None]:
        """A logger's failed write (its own files, under the run directory) as StorageError."""
        with storage_errors(self.run_dir):
            yield
