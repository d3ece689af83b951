"""Typed schemas for the config tree, registered in Hydra's ConfigStore.

`conf/train.yaml` lists `train_schema` first in its defaults, so Hydra merges every yaml on top of these
dataclasses: a wrong type (`trainer.max_epochs=abc`) or an unknown key fails at composition, before a run
directory exists. Groups whose keys differ per option (model, optimizer, scheduler, logger) are `Any` here;
their keys are checked by the constructor they are passed to. The parallel options each have a schema of their
own, which the option's yaml names in its defaults (`/schema/parallel/ddp@_here_`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hydraloop.resolvers import register_resolvers


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
    max_tokens: int | None = None
    """Or tokens to train in all, for a task that counts them (language_model): the launcher sets `max_steps` to the
    steps of `data.batch_size` x the tokens of a sample that reach it (hydraloop.checks.launch.apply_token_budget)."""
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
    activation_checkpointing: Any = False
    """Modules that keep only their inputs in forward and recompute their activations in backward (less memory, one
    more forward each): true, the model's blocks (its `_no_split_modules`, GPT: Block); a list of module class
    names; false: none. Under every strategy, with the same results (hydraloop.activation_checkpointing)."""
    compile: bool = False
    """torch.compile the model in place (Module.compile), so checkpoint keys stay those of the plain model."""
    grad_accum_steps: int = 1
    """Split each rank's share of the global batch into this many micro-batches; one optimizer step per batch."""
    limit_train_batches: int | None = None
    """Train on at most this many batches per epoch (debugging, start-up benchmarks); null: all."""
    limit_train_samples: int | None = None
    """Train on the first this many samples of each epoch's order; with data.drop_last=false, the epoch's last batch
    holds what is left of them (scripts/check_exact.py makes one smaller than the ranks' micro-batches this way, on
    any data set). null: all."""
    limit_val_batches: int | None = None
    """Evaluate at most this many batches per rank; null: the whole validation set."""
    tf32: bool = True
    """Allow TensorFloat-32 matmuls and convolutions on Ampere and newer GPUs (no effect on CPU)."""
    cudnn_benchmark: bool = True
    """Let cuDNN time its kernels for each input shape and keep the fastest (off in deterministic mode)."""
    channels_last: bool = False
    """Store 2-D conv nets and their 4-D inputs channels-last, the layout tensor cores prefer."""
    cpu_threads: int | None = None
    """Threads each rank computes with on the CPU (torch.set_num_threads). null: PyTorch's default (OMP_NUM_THREADS,
    else one per core), or under ddp and fsdp the rank's share of the machine's cores. Training on the CPU with busy
    DataLoader workers, fewer can be faster: the workers need cores too (docs/benchmarks.md)."""
    nonfinite_loss: str = "stop"
    """A NaN or infinite loss. stop: end the run at the next logging step (or validation, or checkpoint: none is made
    from it), naming the step and rank (free per step). skip: every rank drops that step's update (a collective and
    a host sync per step to decide)."""
    max_consecutive_skips: int = 10
    """nonfinite_loss=skip: this many skipped steps in a row end the run as diverged (skipping is for the odd bad
    batch)."""
    replica_check_every_n_steps: int | None = None
    """Compare the ranks' copies of the parameters, optimizer state and callbacks' state (ddp's ranks, fsdp's
    replicate groups), bit for bit, with one small all-reduce; on a difference end the run naming the first tensor
    that differs, the step and the ranks, before that state is validated or saved (hydraloop.replica_check). null:
    before each validation and checkpoint, and so at the end; N: also after every N-th optimizer step; 0: never.
    Nothing to compare under single, dataparallel, and fsdp with replicate=1."""
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
    padded: bool = False
    """Sequences of their own lengths, padded per batch (data=hf_lm): task=language_model weights the loss by tokens."""
    tokenizer: Any = None
    """data=tokens: the tokenizer that made the token files (from their meta.json), kept with the config so that a
    resume or sampling can tell another tokenizer's corpus."""
    check: Any = None
    """`_target_` called once in the launcher, before any rank starts, that raises ConfigError on bad data (an image
    folder's layout, say), for a data set too costly to build twice; null: the launcher builds the data set itself
    and checks it (hydraloop.checks.data_and_task.check_data)."""
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
    start_method: str = "auto"
    """How this process starts its own ranks: spawn (fresh interpreters, each importing torch and the rest), or auto
    (and fork): on the CPU, copies of this one, which has imported everything (seconds sooner, on less than half the
    CPU); spawned on GPUs (CUDA cannot be used in a forked process) and where a fork would not be whole (a thread or
    a multiprocessing fork server started since the imports). fork says so when it spawns."""
    sync_batchnorm: bool = False
    """Batch norm over the global batch (torch.nn.SyncBatchNorm on CUDA, hydraloop's GlobalBatchNorm on the CPU):
    a model with batch norm then trains to single-process training's numbers. false: each rank normalises with its
    own shard's statistics (pytorch/examples' ImageNet recipe), cheaper, but not single's numbers."""


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
    build_on_meta: bool = True
    """Rank 0 builds the model in full on the CPU (single-process training's initial or pretrained values), every
    other rank on the meta device (shapes, no memory); each rank then allocates only its own shards on its device and
    receives their values from rank 0. No device ever holds the whole model. false: every rank builds the whole model
    and moves it to its device before sharding (for a model that keeps tensors outside its parameters and buffers)."""
    replicate: int = 1
    """Hybrid sharding (HSDP): the ranks form `replicate` groups of world_size / replicate; each group holds one
    sharded copy of the model, and gradients are also averaged across groups. Shard within a node, replicate across
    nodes: replicate = the number of nodes. 1: plain FSDP, one copy sharded over all ranks."""
    checkpoint: str = "sharded"
    """sharded: every checkpoint is a directory in which each rank writes, and reads back, its own shards
    (torch.distributed.checkpoint; any number of ranks, and single or ddp, resume from it); full: one file, whole,
    which rank 0 gathers (its host memory must hold the model and optimizer state)."""
    async_checkpoint: bool = False
    """With checkpoint=sharded: the shards are copied to host memory and written in the background while training
    goes on; the next checkpoint, a stop signal and the end of the run wait for it."""


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
    callbacks: Any = field(default_factory=dict)
    """Callbacks by name (hydraloop.callbacks): `callbacks=[ema]`."""
    metrics: Any = field(default_factory=dict)
    """More validation metrics by name (hydraloop.metrics): torchmetrics classes, reported as val/NAME."""
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
    ckpt_weights: str = "model"
    """mode=eval and mode=predict: the weights of `ckpt_path` to use: model (as trained), or the name of a callback
    that saved weights of its own (ema: the average of callbacks.ema)."""
    resume: bool = True
    """Continue from the run directory's own checkpoints/last.pt when there is one (a job restarted by torchrun,
    requeued by SLURM, or rerun into the same `hydra.run.dir` after a stop signal); it takes precedence over
    `ckpt_path`. false: start from `ckpt_path` or from scratch, overwriting the directory's checkpoints."""
    optimized_metric: str = "${default_metric:${task._target_}}"
    """Returned to sweepers and used to choose checkpoints/best.pt; one of the task's metrics (default: its own)."""
    optimized_metric_mode: str = "${metric_mode:${task._target_},${optimized_metric},${metrics}}"
    """max or min: which direction of `optimized_metric` is better (default: the task's for that metric)."""
    output_dir: str = "${hydra:runtime.output_dir}"
    """The run directory; every rank writes into the launcher's, never one of its own."""
    log_file: str = "${hydra:runtime.output_dir}/${hydra:job.name}.log"


def register_configs() -> None:
    """The schemas in Hydra's ConfigStore, and the resolvers the yaml files use (hydraloop.resolvers)."""
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="schema/parallel", name="single", node=SingleConfig)
    cs.store(group="schema/parallel", name="dataparallel", node=DataParallelConfig)
    cs.store(group="schema/parallel", name="ddp", node=DDPConfig)
    cs.store(group="schema/parallel", name="fsdp", node=FSDPConfig)
