"""What rank 0 writes: logger runs, checkpoints, metrics.json, profiler traces, and the console progress bar.

Every other rank gets NullRunWriter, so the training loop calls the same methods on all ranks and never asks
"am I rank 0?".
"""

import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hydraloop.checkpoint import save_atomic
from hydraloop.console import progress_bar
from hydraloop.loggers import JobInfo, NullLogger, RunInfo
from hydraloop.profiling import NullProfiler, step_profiler


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
        pass


class RunWriter(NullRunWriter):
    def __init__(
        self,
        run_dir: str | Path,
        logger: NullLogger,
        config: dict[str, Any],
        save_checkpoints: bool,
        profile: bool,
        num_params: int = 0,
        job: JobInfo | None = None,
    ) -> None:
        """`num_params`: the model's parameter count; `job`: the Hydra job's overrides and multirun, if any."""
        self.run_dir = Path(run_dir)
        self.logger = logger
        self.save_checkpoints = save_checkpoints
        self.profile = profile
        self.num_params = num_params
        logger.start(RunInfo(self.run_dir, config, num_params, job or JobInfo()))

    def progress(self, total_steps: int, done_steps: int) -> AbstractContextManager[tqdm]:
        return progress_bar(total_steps, done_steps)

    def profiler(self) -> AbstractContextManager:
        return step_profiler(self.run_dir / "tensorboard" / "profiler") if self.profile else NullProfiler()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step)

    def save_checkpoint(self, make_state: Callable[[], dict[str, Any]], is_best: bool) -> None:
        """checkpoints/last.pt always; checkpoints/best.pt too when the optimized metric improved."""
        if not self.save_checkpoints:
            return
        state = make_state()
        save_atomic(state, self.run_dir / "checkpoints" / "last.pt")
        if is_best:
            save_atomic(state, self.run_dir / "checkpoints" / "best.pt")

    def finish(self, metrics: dict[str, Any]) -> None:
        """Final metrics: to the loggers, and as metrics.json (written atomically)."""
        metrics = {**metrics, "model/params": self.num_params}
        self.logger.finish(metrics)
        tmp = self.run_dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "metrics.json")
