"""Typed schemas for the config tree, registered in Hydra's ConfigStore.

`conf/train.yaml` lists `train_schema` first in its defaults, so Hydra merges every yaml on top of these
dataclasses: a wrong type (`trainer.max_epochs=abc`) or an unknown key fails at composition, before a run
directory exists. Groups whose keys differ per option (model, optimizer, scheduler, logger) are `Any` here;
their keys are checked by the constructor they are passed to. The parallel options each have a schema of their
own, which the option's yaml names in its defaults (`/schema/parallel/ddp@_here_`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hydraloop.errors import ConfigError
from hydraloop.resolvers import ARITHMETIC_AND_DATA

PRECISIONS = ("32", "bf16", "fp16")
VAL_METRICS = ("val/acc", "val/loss")
"""What the validation pass reports; `optimized_metric` names one of them."""


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    """Epochs to train; with `ckpt_path`, the total including those already done."""
    log_every_n_steps: int = 10
    """Console and TensorBoard train metrics every this many optimizer steps (a sync point, so not every step)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this value; null turns clipping off."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): slower, bit-reproducible kernels."""
    save_checkpoints: bool = True
    """Write checkpoints/last.pt every epoch and checkpoints/best.pt when `optimized_metric` improves."""
    precision: str = "32"
    """32 (float32), bf16 or fp16: autocast for the forward pass and loss; fp16 adds a GradScaler."""
    compile: bool = False
    """torch.compile the model in place (Module.compile), so checkpoint keys stay those of the plain model."""
    grad_accum_steps: int = 1
    """Split each rank's share of the global batch into this many micro-batches; one optimizer step per batch."""
    limit_train_batches: int | None = None
    """Train on at most this many batches per epoch (debugging, start-up benchmarks); null: all."""
    limit_val_batches: int | None = None
    """Evaluate at most this many batches per rank; null: the whole validation set."""
    tf32: bool = True
    """Allow TensorFloat-32 matmuls and convolutions on Ampere and newer GPUs (no effect on CPU)."""
    cudnn_benchmark: bool = True
    """Let cuDNN time its kernels for each input shape and keep the fastest (off in deterministic mode)."""
    channels_last: bool = False
    """Store 2-D conv nets and their 4-D inputs channels-last, the layout tensor cores prefer."""
    nonfinite_loss: str = "stop"
    """A NaN or infinite loss. stop: end the run at the next logging step, naming the step and rank (free per step).
    skip: every rank drops that step's update (a collective and a host sync per step to decide); a logging interval
    of nothing but skipped steps still ends the run."""
    profile: bool = False
    """torch.profiler over steps 2-5 of the run (rank 0); the trace goes to tensorboard/profiler/."""


@dataclass
class DataConfig:
    batch_size: int = MISSING
    """The GLOBAL batch size per optimizer step; each of N ranks loads batch_size / N."""
    input_shape: list[int] = MISSING
    """Shape of one sample without the batch dimension; models read it through interpolation."""
    num_classes: int = MISSING
    val_batch_size: int | None = None
    """Global evaluation batch size; null: same as batch_size."""
    num_workers: Any = 0
    """DataLoader worker processes per rank; 0 loads in the training process (best for small in-memory sets); auto:
    this rank's share of the CPU cores, less one for the rank itself (hydraloop.data.loaders.auto_num_workers)."""
    drop_last: bool = True
    """Drop the last incomplete global batch, so every step sees `batch_size` samples and DDP matches single."""
    shuffle: bool = True
    """Reshuffle the training set every epoch (the same permutation on every rank); false: a fixed order."""
    on_device: bool = False
    """Keep the whole data set as tensors on the device and draw batches by index, in the sampler's order,
    without a DataLoader (for data sets that fit in device memory; ignores num_workers)."""
    prefetch_factor: int | None = None
    """Batches each DataLoader worker loads ahead; null: PyTorch's default (2). Needs num_workers > 0."""
    dataset: Any = MISSING
    """`_target_` returning (train, val) datasets, with its own keys."""
    check: Any = None
    """`_target_` called once in the launcher, before any rank starts, that raises ConfigError on bad data (an image
    folder's layout, say); null: none."""
    image_size: int | None = None
    """Image data: the side of the square crops the model sees; the transforms and input_shape follow from it."""
    train_transforms: Any = None
    """Image data: a list of `_target_`s (torchvision.transforms.v2) applied in order, ending in a float tensor."""
    val_transforms: Any = None
    """Image data: the same for validation (deterministic: no random crops)."""


@dataclass
class SingleConfig:
    _target_: str = "hydraloop.parallel.single.SingleDevice"


@dataclass
class DataParallelConfig:
    _target_: str = "hydraloop.parallel.dataparallel.DataParallelStrategy"
    device_ids: list[int] | None = None
    """GPUs to split each batch over; null: all visible GPUs."""


@dataclass
class ProcessGroupConfig:
    """What every one-process-per-device strategy shares: how its ranks start, meet and stop."""

    nproc_per_node: int | None = None
    """Worker processes to start on this machine; null: one per visible GPU, or 2 on a CPU-only machine."""
    backend: str | None = None
    """Process-group backend; null: nccl on CUDA, gloo on CPU."""
    timeout_s: float = 300.0
    """Process-group timeout: a collective that waits longer than this fails instead of hanging."""
    max_restarts: int = 0
    """Restart all ranks this many times after a failure; they continue from the run's checkpoints/last.pt."""
    shutdown_timeout_s: float = 60.0
    """On a stop signal, how long the ranks get to checkpoint and exit before they are killed."""


@dataclass
class DDPConfig(ProcessGroupConfig):
    _target_: str = "hydraloop.parallel.ddp.DDPStrategy"
    find_unused_parameters: bool = False
    bucket_cap_mb: float = 25.0
    """Gradients are all-reduced in buckets of about this size, overlapping with the backward pass."""
    gradient_as_bucket_view: bool = True
    """Gradients alias DDP's communication buckets: one copy less per step, less memory."""
    static_graph: bool = False
    """Promise that the set of used parameters never changes between steps, enabling more optimisations."""


@dataclass
class FSDPConfig(ProcessGroupConfig):
    _target_: str = "hydraloop.parallel.fsdp.FSDPStrategy"
    shard_modules: list[str] | None = field(default_factory=lambda: ["Linear"])
    """Class names of the modules that each become one FSDP unit (all-gathered together); the root unit takes
    the remaining parameters. Each name must match a module of the model. null or []: one unit, the root."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward and gather them again for backward: less memory,
    more communication. false keeps them until backward."""
    param_dtype: str | None = None
    """null, float32 or bfloat16: the dtype forward and backward compute in (the sharded weights and the
    optimizer stay float32). null: the parameters' own dtype."""
    reduce_dtype: str | None = None
    """null, float32 or bfloat16: the dtype gradients are reduce-scattered in. null: `param_dtype`."""


@dataclass
class TrainConfig:
    parallel: Any = MISSING
    data: DataConfig = MISSING
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    logger: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    mode: str = "train"
    """train, or eval: evaluate the weights of `ckpt_path` on the validation set and write metrics.json."""
    seed: int = 0
    """Seeds model init and data order (the same on every rank) and, offset by rank, per-rank randomness."""
    device: str = "auto"
    """auto: cuda if available, else cpu. DDP uses the local rank's GPU."""
    ckpt_path: str | None = None
    """Resume from this checkpoint: weights, optimizer, scheduler, epoch, step and RNG state."""
    resume: bool = True
    """Continue from the run directory's own checkpoints/last.pt when there is one (a job restarted by torchrun,
    requeued by SLURM, or rerun into the same `hydra.run.dir` after a stop signal); it takes precedence over
    `ckpt_path`. false: start from `ckpt_path` or from scratch, overwriting the directory's checkpoints."""
    optimized_metric: str = "val/acc"
    """Returned to sweepers and used to choose checkpoints/best.pt."""
    optimized_metric_mode: str = "max"
    """max or min: which direction of `optimized_metric` is better."""
    output_dir: str = "${hydra:runtime.output_dir}"
    """The run directory; every rank writes into the launcher's, never one of its own."""
    log_file: str = "${hydra:runtime.output_dir}/${hydra:job.name}.log"


def shared_run_path() -> str:
    """The run folder's path under outputs/, `DATE/TIME`, the same in every process of one job.

    Started by plain `python`, only the launching process runs Hydra: the time is enough. Under torchrun every
    rank runs Hydra itself, and `${now:...}` would differ between ranks (and nodes) that start in different
    seconds, so the ranks agree through the elastic agent's key-value store: the first rank to ask sets the name,
    the others read it. The store outlives worker restarts (`--max-restarts`), so a restarted job finds its own
    folder again. Tasks that SLURM starts directly share the job id.
    """
    name = time.strftime("%Y-%m-%d/%H-%M-%S")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from torch.distributed import TCPStore  # only here: importing torch.distributed costs start-up time

        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=5)
        )
        return store.compare_set("hydraloop/run_name", "", name).decode()
    if os.environ.get("SLURM_JOB_ID"):
        return time.strftime(f"%Y-%m-%d/slurm-{os.environ['SLURM_JOB_ID']}")
    return name


def rank_zero_only(value: Any) -> Any:
    """`value` in rank 0 (or a process that is not a rank), null elsewhere: for Hydra's `.hydra/` subfolder, which
    every rank would otherwise write into the shared run folder. Hydra resolves it before `main` runs, so before
    hydraloop.parallel.cluster sets RANK in a submitit task: there the task's own rank variables tell."""
    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        if key in os.environ:
            return value if os.environ[key] == "0" else None
    return value


def register_configs() -> None:
    """The schemas, and the resolvers: `${sweep_direction:max}` -> maximize (for sweepers), `${shared_run_path:}`,
    `${rank_zero_only:value}`, `${image_folder_classes:root}`, `${linear_scaling:0.1,256,${data.batch_size}}`,
    `${resize_for_center_crop:224}`."""
    if not OmegaConf.has_resolver("sweep_direction"):
        OmegaConf.register_new_resolver("sweep_direction", lambda mode: {"max": "maximize", "min": "minimize"}[mode])
    if not OmegaConf.has_resolver("shared_run_path"):
        OmegaConf.register_new_resolver("shared_run_path", shared_run_path, use_cache=True)
    if not OmegaConf.has_resolver("rank_zero_only"):
        OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only)
    for name, resolver in ARITHMETIC_AND_DATA.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="schema/parallel", name="single", node=SingleConfig)
    cs.store(group="schema/parallel", name="dataparallel", node=DataParallelConfig)
    cs.store(group="schema/parallel", name="ddp", node=DDPConfig)
    cs.store(group="schema/parallel", name="fsdp", node=FSDPConfig)


def check_config(cfg: Any, world_size: int) -> None:
    """What the schema's types cannot say: ranges, and how the global batch splits over `world_size` ranks."""
    _require(cfg.mode in ("train", "eval"), f"mode={cfg.mode}: must be train or eval")
    _require(cfg.mode != "eval" or cfg.ckpt_path, "mode=eval: needs ckpt_path=<checkpoint to evaluate>")
    _require(cfg.seed >= 0, f"seed={cfg.seed}: must be non-negative")
    batch_size = cfg.data.batch_size
    _require(batch_size > 0, f"data.batch_size={batch_size}: must be positive")
    _require(
        batch_size % world_size == 0,
        f"data.batch_size={batch_size}: not divisible by the world size {world_size} "
        "(it is the global batch, split evenly over the ranks)",
    )
    workers = cfg.data.num_workers
    _require(
        workers == "auto" or isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0,
        f"data.num_workers={workers}: must be a number of worker processes (0 or more) or auto",
    )
    val_batch_size = cfg.data.val_batch_size
    _require(val_batch_size is None or val_batch_size > 0, f"data.val_batch_size={val_batch_size}: must be positive")
    _require(cfg.trainer.max_epochs > 0, f"trainer.max_epochs={cfg.trainer.max_epochs}: must be positive")
    _require(
        cfg.trainer.log_every_n_steps > 0,
        f"trainer.log_every_n_steps={cfg.trainer.log_every_n_steps}: must be positive",
    )
    accum = cfg.trainer.grad_accum_steps
    _require(accum > 0, f"trainer.grad_accum_steps={accum}: must be positive")
    _require(
        batch_size % (world_size * accum) == 0,
        f"trainer.grad_accum_steps={accum}: data.batch_size={batch_size} does not split into {world_size} rank(s) "
        f"x {accum} equal micro-batches",
    )
    nonfinite = cfg.trainer.nonfinite_loss
    _require(nonfinite in ("stop", "skip"), f"trainer.nonfinite_loss={nonfinite}: must be stop or skip")
    precision = str(cfg.trainer.precision)
    _require(precision in PRECISIONS, f"trainer.precision={precision}: must be one of {', '.join(PRECISIONS)}")
    for key in ("limit_train_batches", "limit_val_batches"):
        limit = cfg.trainer[key]
        _require(limit is None or limit > 0, f"trainer.{key}={limit}: must be positive, or null for no limit")
    clip = cfg.trainer.grad_clip_norm
    _require(clip is None or clip > 0, f"trainer.grad_clip_norm={clip}: must be positive, or null for no clipping")
    lr = cfg.optimizer.get("lr")
    _require(
        isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf,
        f"optimizer.lr={lr}: must be a positive finite number",
    )
    metric = cfg.optimized_metric
    _require(metric in VAL_METRICS, f"optimized_metric={metric}: must be one of {', '.join(VAL_METRICS)}")
    mode = cfg.optimized_metric_mode
    _require(mode in ("max", "min"), f"optimized_metric_mode={mode}: must be max or min")


def check_required(cfg: Any) -> None:
    """`???` in a yaml marks a value the user must give, e.g. data=tensors's data.dataset.path."""
    missing = list(_missing_paths(OmegaConf.to_container(cfg, resolve=False)))  # interpolations stay text
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required; set it on the command line, e.g. {missing[0]}=...")


def _missing_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, (dict, list)):
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            yield from _missing_paths(value, f"{prefix}{key}.")
    elif node == "???":
        yield prefix.rstrip(".")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
