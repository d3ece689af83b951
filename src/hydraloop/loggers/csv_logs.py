"""logger=csv: `<run dir>/metrics.csv`, one row per logged step, no dependency (for offline clusters, spreadsheets,
pandas). The config and the final metrics are beside it, in `.hydra/config.yaml` and `metrics.json`."""

from __future__ import annotations

import atexit
import csv
import os
from pathlib import Path
from typing import Any

from hydraloop.loggers.base import NullLogger, RunInfo


class CSVLogger(NullLogger):
    """Columns `step` and every metric name in the order first logged; a metric not logged at a step is empty.

    Metrics logged at the same step (a logging step that ends an epoch gives train and validation metrics) share
    one row, so a row is written once the next step begins, before a checkpoint, or when the run ends; a metric of
    a step whose row is written already joins it. A metric name that appears late (the first validation) rewrites
    the file once with the wider header. A resumed run keeps the rows up to the step it resumed from and appends to
    them; a fresh start into the same directory starts the file over.
    """

    def start(self, run: RunInfo) -> None:
        self.path = Path(run.run_dir) / "metrics.csv"
        self.columns = ["step"]
        rows = []
        if self.path.is_file():  # an earlier run of this directory: keep its rows up to where this one resumed
            with self.path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                rows = [row for row in reader if run.start_step and int(row["step"]) <= run.start_step]
            if rows:
                self._rewrite(list(rows[0]), rows)
            else:
                self.path.unlink()
        self.row: dict[str, Any] = {}
        self.written_step: int | None = int(rows[-1]["step"]) if rows else None
        atexit.register(self._write_row)  # a run that fails still leaves its last row

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.row and self.row["step"] != step:
            self._write_row()
        self.row.update(metrics, step=step)

    def flush(self) -> None:
        self._write_row()

    def interrupted(self, signum: int) -> None:
        self._write_row()

    def finish(self, metrics: dict[str, Any]) -> None:
        self._write_row()
        atexit.unregister(self._write_row)

    def _write_row(self) -> None:
        if not self.row:
            return
        row, self.row = self.row, {}
        new = [name for name in row if name not in self.columns]
        if row["step"] == self.written_step:  # joins the row written for this step (rare: after a checkpoint)
            with self.path.open(newline="") as handle:
                rows = list(csv.DictReader(handle))
            rows[-1].update({key: value for key, value in row.items() if key != "step"})
            self._rewrite(self.columns + new, rows)
            return
        if new:
            self._rewrite(self.columns + new)
        self.written_step = row["step"]
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            if handle.tell() == 0:
                writer.writeheader()
            writer.writerow(row)

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]] | None = None) -> None:
        """`rows` (default: the file's) under the header `columns`; written to a temporary file and renamed, so never
        half a file."""
        self.columns = columns
        if rows is None:
            if not self.path.is_file():
                return
            with self.path.open(newline="") as handle:
                rows = list(csv.DictReader(handle))
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
