"""Typed schemas for the config tree, registered in Hydra's ConfigStore.

`conf/train.yaml` lists `train_schema` first in its defaults, so Hydra merges every yaml on top of these
dataclasses: a wrong type (`trainer.max_epochs=abc`) or an unknown key fails at composition, before a run
directory exists. Groups whose keys differ per option (model, optimizer, scheduler, logger) are `Any` here;
their keys are checked by the constructor they are passed to. The parallel options each have a schema of their
own, which the option's yaml names in its defaults (`/schema/parallel/ddp@_here_`).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from hydraloop.errors import ConfigError
from hydraloop.resolvers import ARITHMETIC_AND_DATA

PRECISIONS = ("32", "bf16", "fp16")


@dataclass
class EarlyStoppingConfig:
    patience: int | None = None
    """Stop after this many validations in a row that do not improve `optimized_metric` by more than `min_delta`;
    null: never."""
    min_delta: float = 0.0


@dataclass
class TrainerConfig:
    max_epochs: int = 20
    """Epochs to train; with `ckpt_path`, the total including those already done. Ignored when `max_steps` is set."""
    max_steps: int | None = None
    """Optimizer steps to train in all (mid-epoch if need be), the total including those already done when resuming;
    schedulers plan for it. null: `max_epochs` decides."""
    val_every_n_steps: int | None = None
    """Also validate (and keep checkpoints/best.pt) every this many steps, besides each epoch end; null: epoch ends."""
    ckpt_every_n_steps: int | None = None
    """Also write checkpoints/last.pt every this many steps, besides each epoch end; null: epoch ends."""
    log_every_n_steps: int = 10
    """Console and TensorBoard train metrics every this many optimizer steps (a sync point, so not every step)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this value; null turns clipping off."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): slower, bit-reproducible kernels."""
    save_checkpoints: bool = True
    """Write checkpoints/last.pt every epoch and checkpoints/best.pt when `optimized_metric` improves."""
    keep_last_k: int = 2
    """Step-named checkpoints (checkpoints/step-00000120.pt) kept beside last.pt, which is a second name of the
    newest; resuming from a last.pt that cannot be read falls back to the newest readable one. 1: no fallback."""
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
    peak_tflops: float | None = None
    """One GPU's peak dense TFLOP/s, for perf/mfu; null: looked up from the GPU's name (hydraloop.perf)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    eval_best: bool = False
    """After training, evaluate checkpoints/best.pt too, and add its metrics to metrics.json as best/<name>."""


@dataclass
class DataConfig:
    batch_size: int = MISSING
    """The GLOBAL batch size per optimizer step; each of N ranks loads batch_size / N."""
    input_shape: list[int] = MISSING
    """Shape of one sample without the batch dimension; models read it through interpolation."""
    num_classes: int = MISSING
    """The number of classes; more generally, the width of the model's output (prod(target_shape) for regression)."""
    target_shape: list[int] | None = None
    """Real-valued targets' shape per sample (task=regression), e.g. [] for one value; null: integer class labels."""
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
    predict_path: str | None = None
    """mode=predict: a .npz or .pt file holding `x`, the inputs (N, *input_shape) to predict (hydraloop.predict)."""
    prefetch_factor: int | None = None
    """Batches each DataLoader worker loads ahead; null: PyTorch's default (2). Needs num_workers > 0."""
    num_folds: int | None = None
    """k-fold cross-validation: split the data set's pool into this many folds (stratified by class) and validate
    on fold `fold`; `-m data.fold=0,1,...` runs them all. null: the data set's own train/val split."""
    fold: int = 0
    """The validation fold, in [0, num_folds)."""
    dataset: Any = MISSING
    """`_target_` returning (train, val) datasets, with its own keys."""
    block_size: int | None = None
    """Sequence data (data=text): tokens per sample, the context length a model reads as model.block_size."""
    vocab: str | None = None
    """data=text: the vocabulary, resolved from the file (hydraloop.data.text); null at byte level."""
    vocab_size: int | None = None
    """Sequence data: the number of distinct tokens, read by a language model as model.vocab_size."""
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
    shard_modules: list[str] | None = None
    """Class names of the modules that each become one FSDP unit (all-gathered together); the root unit takes
    the remaining parameters. Each name must match a module of the model. null: the model's `_no_split_modules`
    (GPT: [Block]), else [Linear]. []: one unit, the root."""
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
    task: Any = MISSING
    """What the loop optimises and validation reports (hydraloop.tasks)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    mode: str = "train"
    """train; eval: evaluate the weights of `ckpt_path` on the validation set and write metrics.json; predict: write
    the predictions of `ckpt_path`'s model for the inputs in `data.predict_path` (hydraloop.predict)."""
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
    optimized_metric: str = "${default_metric:${task._target_}}"
    """Returned to sweepers and used to choose checkpoints/best.pt; one of the task's metrics (default: its own)."""
    optimized_metric_mode: str = "${metric_mode:${task._target_},${optimized_metric}}"
    """max or min: which direction of `optimized_metric` is better (default: the task's for that metric)."""
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


def run_owner_only(value: Any) -> Any:
    """`value` in the process that will own the run directory, null elsewhere: for Hydra's `.hydra` subfolder,
    which Hydra writes before `main` runs. That process is rank 0 (see rank_zero_only), when the directory can be
    written and no other live run holds it (hydraloop.run_lock): a run refused at start leaves the owner's `.hydra`
    alone."""
    from hydra.core.hydra_config import HydraConfig

    from hydraloop.run_lock import may_own

    value = rank_zero_only(value)
    if value is None or not HydraConfig.initialized():
        return value
    return value if may_own(HydraConfig.get().runtime.output_dir) else None


class ResolverConfigError(InterpolationResolutionError, ConfigError):
    """A ConfigError raised by a resolver. OmegaConf passes its own errors through as they are, where it would wrap
    any other in a message of several lines and drop the cause: so this one still ends the run as one line."""

    _initialized = True  # tells OmegaConf's error formatting that the message is complete


def _reporting_config_errors(resolver: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(resolver)
    def resolve(*args: Any) -> Any:
        try:
            return resolver(*args)
        except ConfigError as error:
            raise ResolverConfigError(str(error)) from None

    return resolve


def register_configs() -> None:
    """The schemas, and the resolvers: `${sweep_direction:max}` -> maximize (for sweepers), `${shared_run_path:}`,
    `${rank_zero_only:value}`, `${run_owner_only:value}`, `${default_metric:<task class>}`,
    `${metric_mode:<task class>,<metric>}`, data=text's `${text_vocab:path,level}` and `${text_vocab_size:vocab}`,
    `${image_folder_classes:root}`, `${linear_scaling:0.1,256,${data.batch_size}}`, `${resize_for_center_crop:224}`."""
    from hydraloop.data import text  # here, not at the top: the module imports torch and numpy

    for name, resolver in (("text_vocab", text.text_vocab), ("text_vocab_size", text.vocab_size)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, _reporting_config_errors(resolver))
    if not OmegaConf.has_resolver("sweep_direction"):
        OmegaConf.register_new_resolver("sweep_direction", lambda mode: {"max": "maximize", "min": "minimize"}[mode])
    if not OmegaConf.has_resolver("shared_run_path"):
        OmegaConf.register_new_resolver("shared_run_path", shared_run_path, use_cache=True)
    if not OmegaConf.has_resolver("rank_zero_only"):
        OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only)
    if not OmegaConf.has_resolver("run_owner_only"):
        OmegaConf.register_new_resolver("run_owner_only", run_owner_only)
    if not OmegaConf.has_resolver("default_metric"):
        OmegaConf.register_new_resolver("default_metric", lambda task: get_class(task).default_metric)
    if not OmegaConf.has_resolver("metric_mode"):
        # An unknown metric gets a placeholder here: check_task names the valid ones in one line.
        OmegaConf.register_new_resolver("metric_mode", lambda task, metric: get_class(task).metrics.get(metric, "max"))
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
    _require(cfg.mode in ("train", "eval", "predict"), f"mode={cfg.mode}: must be train, eval or predict")
    purpose = {"eval": "evaluate", "predict": "predict with"}.get(cfg.mode)
    _require(cfg.mode == "train" or cfg.ckpt_path, f"mode={cfg.mode}: needs ckpt_path=<checkpoint to {purpose}>")
    _require(
        cfg.mode != "predict" or cfg.data.predict_path,
        "mode=predict: needs data.predict_path=<.npz or .pt file holding x, the inputs>",
    )
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
    for key in ("max_steps", "val_every_n_steps", "ckpt_every_n_steps", "peak_tflops", "early_stopping.patience"):
        value = OmegaConf.select(cfg.trainer, key)
        _require(value is None or value > 0, f"trainer.{key}={value}: must be positive, or null")
    min_delta = cfg.trainer.early_stopping.min_delta
    _require(min_delta >= 0, f"trainer.early_stopping.min_delta={min_delta}: must be at least 0")
    _require(
        not cfg.trainer.eval_best or cfg.trainer.save_checkpoints,
        "trainer.eval_best=true: needs trainer.save_checkpoints=true, for checkpoints/best.pt",
    )
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
    keep = cfg.trainer.keep_last_k
    _require(keep >= 1, f"trainer.keep_last_k={keep}: must be at least 1 (the newest checkpoint is one of them)")
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
    mode = cfg.optimized_metric_mode
    _require(mode in ("max", "min"), f"optimized_metric_mode={mode}: must be max or min")
    _check_folds(cfg.data)


def _check_folds(data: Any) -> None:
    num_folds, fold = data.num_folds, data.fold
    if num_folds is None:
        _require(fold == 0, f"data.fold={fold}: needs data.num_folds (k-fold cross-validation)")
        return
    _require(num_folds >= 2, f"data.num_folds={num_folds}: must be at least 2, or null for no k-fold")
    _require(0 <= fold < num_folds, f"data.fold={fold}: must be in [0, data.num_folds={num_folds})")
    _require(
        "num_folds" in data.dataset,
        f"data.num_folds={num_folds}: the data set {data.dataset.get('_target_')} takes no num_folds "
        "(see hydraloop.data.folds for how the in-memory data sets do k-fold)",
    )


def check_task(cfg: Any, task: Any) -> None:
    """The task fits the data and model, and reports `optimized_metric`."""
    task.check(cfg)
    metric, reported = cfg.optimized_metric, task.reported_metrics()
    _require(metric in reported, f"optimized_metric={metric}: the task reports {', '.join(reported)}")


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
