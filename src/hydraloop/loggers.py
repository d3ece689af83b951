"""Metric loggers (the `logger` config group). Ranks other than 0 always get NullLogger."""

from pathlib import Path
from typing import Any


class NullLogger:
    """Logs nothing: `logger=none`, and every rank but 0."""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, tag: str, text: str) -> None:
        pass

    def log_hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger(NullLogger):
    """Event files in `<run dir>/tensorboard`: `tensorboard --logdir outputs` shows every run."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ~1 s of imports; only rank 0 pays it

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_text(self, tag: str, text: str) -> None:
        self.writer.add_text(tag, text)

    def log_hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # Written into this run's own event file (SummaryWriter.add_hparams would start a new sub-run). The
        # HParams view reads each metric's value from the run's own scalar of that name, already logged.
        experiment, session_start, session_end = hparams_summary(hparams, metrics)
        file_writer = self.writer._get_file_writer()
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.close()
