"""logger=tensorboard: event files in `<run dir>/tensorboard`; `tensorboard --logdir outputs` shows every run."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from hydraloop.loggers.base import NullLogger, RunInfo


class TensorBoardLogger(NullLogger):
    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ~1 s of imports; only rank 0 pays it
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        log_dir = run.run_dir / "tensorboard"
        continues = run.start_step > 0 and any(log_dir.glob("events.out.tfevents.*"))
        # An earlier run of this directory: TensorBoard drops what its event files hold from the purge step on, the
        # steps a killed run logged after its last checkpoint (all of it, for a fresh start into the directory).
        purge_step = run.start_step + 1 if continues else 0 if log_dir.is_dir() else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.val_metrics = run.val_metrics
        if not continues:
            # Indented four spaces: TensorBoard's text plugin renders that as a code block.
            config_yaml = OmegaConf.to_yaml(run.config)
            self.writer.add_text("config", "\n".join("    " + line for line in config_yaml.splitlines()))
            self.writer.add_scalar("model/params", run.num_params, 0)
        # The HParams tab's row for this run: its overridden keys (a sweep's varying ones among them), written into
        # the run's own event file. SummaryWriter.add_hparams would write them into a new timestamped sub-run, a
        # second row without the run's scalars (pytorch/pytorch#32651). The metric columns read each run's last
        # value of the scalar of that name. Every run declares the same ones whatever it logged (its task's, and the
        # train loss): TensorBoard takes the columns of a sweep's comparison from one run's declaration.
        metrics = dict.fromkeys([*run.val_metrics, "train/epoch_loss"], 0.0)  # only the names are written
        file_writer = self.writer._get_file_writer()
        for summary in hparams_summary(run.hparams, metrics):
            file_writer.add_summary(summary)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()  # the event writer's queue, written out (it would wait for flush_secs)

    def interrupted(self, signum: int) -> None:
        self.writer.flush()

    def finish(self, metrics: dict[str, Any]) -> None:
        # The final validation metrics at the last step as well: a `mode=eval` run logged none before.
        step = metrics.get("global_step", 0)
        for name in self.val_metrics:
            if isinstance(metrics.get(name), float):
                self.writer.add_scalar(name, metrics[name], step)
        self.writer.close()
