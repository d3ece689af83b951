"""hydraloop's one entrypoint: `python src/train.py [group=option ...] [key=value ...]`.

Reads top to bottom: `main` runs once, in the launching process (checks the config, starts the ranks); `train`
runs in every rank (sets up the parallel strategy; `build_and_run` builds the run's parts from the config with
hydraloop.build, runs the loop, and writes the final metrics).
"""

import gc
import signal

# Ctrl-C while the imports below run ends the process by the signal, as a stop signal there does, before anything is
# written: Python's KeyboardInterrupt could be swallowed by the code it lands in (a run went on to its end).
signal.signal(signal.SIGINT, signal.SIG_DFL)

# The imports below create about half a million objects that live as long as the process (torch, Hydra,
# torch._dynamo). The cyclic collector, triggered by allocation counts, would re-scan them again and again while they
# are created: pausing it during the imports, then freezing what they made out of later collections, brings the first
# training step about 1 s sooner (docs/benchmarks.md, benchmark (b)). The run itself collects as usual.
gc.disable()

import atexit
import importlib
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch._dynamo  # noqa: F401  every torch.optim optimizer imports it in its constructor: import it while paused
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hydraloop.backends import configure_backends
from hydraloop.build import build_run_parts
from hydraloop.checkpoint import TrainState, load_checkpoint
from hydraloop.checks.command_line import check_command_line
from hydraloop.checks.composition import resolved
from hydraloop.checks.config_values import check_required
from hydraloop.checks.launch import check_launch
from hydraloop.config import register_configs
from hydraloop.errors import (
    ConfigError,
    Interrupted,
    StorageError,
    TrainingDiverged,
    WorkerFailed,
    exit_on_error,
    first_line,
    peer_gone,
    require,
    unwrap_instantiation,
)
from hydraloop.loggers import JobInfo
from hydraloop.parallel.cluster import export_submitit_rank_env
from hydraloop.parallel.single import SingleDevice
from hydraloop.parallel.spawned_ranks import count_threads_before_computing
from hydraloop.parallel.sweep_share import take_machine_share
from hydraloop.predict import predict
from hydraloop.preemption import STOP_SIGNALS, interrupt_once, stop_in
from hydraloop.rank_logging import FORMAT, JOB_LOG_ONLY, setup_rank_logging
from hydraloop.resume import check_resumable, checkpoint_to_resume, finished_records
from hydraloop.run_lock import owned_run_directory
from hydraloop.run_records import held_until_accepted, holds_training_run
from hydraloop.run_writer import loggers_ended_on_ctrl_c
from hydraloop.seeding import seeded_build
from hydraloop.trainer import Trainer
from hydraloop.trial import first_call_named, named_option

gc.freeze()
gc.enable()
signal.signal(signal.SIGINT, interrupt_once)  # Ctrl-C: KeyboardInterrupt, once (hydraloop.preemption)
count_threads_before_computing()  # parallel.start_method=auto forks ranks only from a process that has started none

log = logging.getLogger("hydraloop.train")
PEER_GONE_WAIT_S = 2.0
register_configs()
# conf/hydra/launcher/joblib.yaml replaces the joblib plugin's own option of that name (fixing n_jobs): Hydra then
# validates it against the plugin's schema, as intended, and says at every composition that this will change.
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/joblib' is validated against ConfigStore schema")


def train(cfg: DictConfig, job: JobInfo) -> dict:
    """One rank's work. Returns the final metrics, which are global (reduced over ranks), so equal on all."""
    strategy = instantiate(cfg.parallel, device=cfg.device)
    setup_rank_logging(strategy.rank, cfg.log_file)
    try:
        strategy.setup()
        metrics = build_and_run(cfg, strategy, job)
    except Exception as error:
        # The process group is torn down at exit, once the launcher has this rank's error on record: the other ranks'
        # collectives fail only then, so the launcher names this rank, not one of them, as the first to fail.
        traceback.clear_frames(error.__traceback__)  # frees what build_and_run made first (see there)
        atexit.register(strategy.teardown)
        # Bad input (also when a data set or model constructor rejected its arguments), a diverged loss, a failed
        # write and a stop signal (also one a library raised an error of its own from): the launcher reports them as
        # one line. Anything else is a failure, logged with its traceback.
        cause = stop_in(error) or unwrap_instantiation(error)
        if isinstance(cause, (ConfigError, TrainingDiverged, StorageError, Interrupted, WorkerFailed)):
            raise cause from None
        if peer_gone(error):  # the consequence of another rank's failure, which the launcher (or torchrun) names
            # A rank that ended without a word (SIGKILL: the OOM killer) fails its peers' collectives at the instant
            # it ends; a moment's wait lets the launcher see that rank end first and name it, not this one. The stop
            # signal the launcher sends the other ranks then must not make this failure a stop: the rank would hand
            # in a result nobody reads, and wait for its SIGKILL.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            time.sleep(PEER_GONE_WAIT_S)
            raise WorkerFailed(f"a collective failed: another rank is gone ({first_line(error)})") from None
        log.exception("training failed")
        error.logged = True  # its traceback is in the log: the launcher of ranks run in this process says one line
        raise
    strategy.teardown()
    return metrics


def build_and_run(cfg: DictConfig, strategy: SingleDevice, job: JobInfo) -> dict:
    """Builds the run's parts from the config (hydraloop.build), then trains or evaluates, and has rank 0 write the
    final metrics; mode=predict predicts (hydraloop.predict).

    A function of its own so that all it builds is freed on return, while the process group still exists. A DDP
    reducer holds the group; were it the group's last owner, its destructor would join gloo's threads while holding
    the GIL, and a gloo thread still freeing the last collective's tensor needs the GIL: a deadlock (torch 2.13).
    """
    configure_backends(
        deterministic=cfg.trainer.deterministic,
        tf32=cfg.trainer.tf32,
        cudnn_benchmark=cfg.trainer.cudnn_benchmark,
        cpu_threads=cfg.trainer.cpu_threads,
    )
    task = seeded_build(cfg.task, cfg.seed)
    if cfg.mode == "predict":
        return predict(cfg, strategy, task)
    run = build_run_parts(cfg, strategy, job, task)
    # A stop signal while training (SIGTERM, SIGUSR1, SIGUSR2): a checkpoint where the ranks next meet, then a stop;
    # one at or after the last step's meeting lets the run finish, metrics.json included (hydraloop.preemption).
    # Ctrl-C: the loggers' runs end where it comes.
    with loggers_ended_on_ctrl_c(run.writer), run.stop_request if cfg.mode == "train" else nullcontext():
        # What the launcher's trial batch could not try (hydraloop.trial): the model's first call failing is one line.
        with first_call_named(strategy.unwrap(run.model), named_option(cfg, "model")):
            if cfg.mode == "eval":
                metrics = run.trainer.validate(run.val_loader, run.state)
            else:
                metrics = run.trainer.fit(run.train_loader, run.val_loader, run.state)
            if cfg.trainer.eval_best:
                metrics.update(evaluate_best(cfg, strategy, run.trainer))
        metrics.update({"model/params": run.num_params, "model/trainable_params": run.trainable_params})
        run.writer.finish(metrics)
    return metrics


def evaluate_best(cfg: DictConfig, strategy: SingleDevice, trainer: Trainer) -> dict:
    """trainer.eval_best: the metrics of checkpoints/best.pt's weights, as best/<name>, with where they were saved.
    None if this run directory has no best.pt (a run with nothing left to train saves none): said in one line."""
    strategy.all_reduce(torch.zeros(1, device=strategy.device))  # a barrier: rank 0 has written best.pt
    path = Path(cfg.output_dir) / "checkpoints" / "best.pt"
    if not path.exists():  # a file, or a sharded checkpoint's folder (parallel=fsdp: a link to its step's folder)
        log.warning("trainer.eval_best=true: %s does not exist: this run saved no checkpoint into its directory", path)
        return {}
    checkpoint = load_checkpoint(path)
    strategy.load_model_state(trainer.model, checkpoint["model"])
    trainer.load_callback_states(checkpoint.get("callbacks", {}))  # val/ema/...: best.pt's average
    best = TrainState.of(checkpoint)
    metrics = {**trainer.validation_metrics(best), "epoch": best.epoch, "global_step": best.global_step}
    return {f"best/{name}": value for name, value in metrics.items()}


def importable(function: Callable) -> Callable:
    """`function` as spawned ranks can unpickle it: by its module and name. Under `python src/train.py` that is
    `__main__`, which each rank re-runs. A worker of hydra/launcher=joblib (or submitit) got this file's functions by
    value from cloudpickle, and its `__main__` is the launcher's: there the ranks import this file as the module
    `train`, from its folder, which spawned processes find on the sys.path they inherit."""
    if getattr(sys.modules["__main__"], function.__name__, None) is function:
        return function
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    return getattr(importlib.import_module(Path(__file__).stem), function.__name__)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    """Checks the config, starts the ranks, and returns `optimized_metric` to Hydra's sweepers. Nothing is written
    into the run directory before every check has passed, and a refused command leaves it as it was
    (hydraloop.run_records)."""
    with exit_on_error(), held_until_accepted(cfg.output_dir) as records:
        check_required(cfg)  # before resolving, which would fail on a `???` with a traceback
        # Resolved here, where Hydra's resolvers work: worker processes get plain values and never touch Hydra.
        composed, cfg = cfg, resolved(cfg)
        export_submitit_rank_env()  # under hydra/launcher=slurm, this process may be one rank of a job
        take_machine_share()  # under hydra/launcher=joblib: this job's GPUs and cores, before CUDA is asked
        strategy = instantiate(cfg.parallel, device=cfg.device)
        setup_rank_logging(strategy.rank, cfg.log_file)  # under torchrun or SLURM every rank runs main: log once
        check_launch(cfg, strategy)  # all that the config and the environment tell, before the directory's lock
        # The launcher of spawned ranks, or rank 0 where every rank runs main, owns the run directory; a directory
        # another live run owns, or one that cannot be written, is refused here.
        with owned_run_directory(cfg.output_dir, cfg.log_file, owner=strategy.is_main_process):
            require(
                cfg.mode == "train" or not holds_training_run(cfg.output_dir),
                f"mode={cfg.mode}: the run directory {cfg.output_dir} holds a training run's records; the "
                f"{cfg.mode} run would write its own metrics.json and logs over them: give it a directory of its own "
                "(without hydra.run.dir, a new one under outputs/)",
            )
            ckpt_path = checkpoint_to_resume(cfg, report=strategy.is_main_process)
            if ckpt_path:
                check_resumable(ckpt_path, cfg)
            finished = finished_records(ckpt_path, cfg, composed)
            if finished is not None:
                log.info(
                    "run directory %s: finished at step %d; its records are left as they are",
                    cfg.output_dir,
                    finished["global_step"],
                )
                records.drop()
                return finished.get(cfg.optimized_metric)
            records.accept(composed, write_config=strategy.is_main_process)
            log.info("run directory: %s (the resolved config is in train.log)", cfg.output_dir)
            log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg).rstrip(), extra=JOB_LOG_ONLY)
            metrics = strategy.launch(importable(train), cfg, JobInfo.from_hydra())
    log.info("final metrics: %s", {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})
    return metrics.get(cfg.optimized_metric)  # none for mode=predict


def check_job(cfg: DictConfig) -> None:
    """The launcher's checks of one job of a sweep, before the first job starts (hydraloop.checks.command_line)."""
    check_launch(cfg, instantiate(cfg.parallel, device=cfg.device))


if __name__ == "__main__":
    # What Hydra would refuse over many lines (exit 1), or a sweep's job would refuse after others ran, is bad input
    # like any other: one line, exit 2, before anything starts. Hydra's logging replaces this console handler.
    logging.basicConfig(format=FORMAT, stream=sys.stdout)
    with exit_on_error():
        check_command_line(sys.argv[1:], Path(__file__).resolve().parent.parent / "conf", check_job)
    main()
