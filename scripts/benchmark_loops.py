"""The two loops scripts/benchmark.py compares, built from the same config: hydraloop's own (its Trainer and loaders,
built as src/train.py builds them) and a minimal hand-written PyTorch loop; each returns a function that runs one
epoch and returns the samples it trained on. Both compute with trainer.cpu_threads threads (PyTorch's default when
null). Also the workloads they run, and the timing of an epoch function.
Imported by benchmark.py, which puts src/ and scripts/ on the path first."""

import itertools
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from make_image_folder import DEFAULT_ROOT
from torch.utils.data import DataLoader, Dataset

from hydraloop.batches import count_rows
from hydraloop.callbacks import build_callbacks
from hydraloop.checkpoint import TrainState
from hydraloop.data.loaders import build_loaders
from hydraloop.data.seeded_augmentation import SeededAugmentation
from hydraloop.optim import build_optimizer
from hydraloop.parallel.single import SingleDevice
from hydraloop.perf import Throughput
from hydraloop.precision import Precision
from hydraloop.run_writer import NullRunWriter
from hydraloop.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_THREADS = torch.get_num_threads()  # before a workload sets its own

IMAGE_FOLDER = ["data=image_folder", f"data.dataset.root={DEFAULT_ROOT}", "data.image_size=16", "data.batch_size=64"]
IMAGE_CNN = [*IMAGE_FOLDER, "data.num_workers=1", "model=cnn", "model.channels=[16,32]"]
# The same digits drawn as 128 x 128 files, cropped to the same 16 x 16: decoding and cropping take longer, as they
# do for photographs, while the model's step stays the same.
LARGER_FILES = DEFAULT_ROOT.with_name(f"{DEFAULT_ROOT.name}_128")
# The bundled plays as character token files (scripts/prepare_text.py), for data=tokens.
TOKEN_DIR = DEFAULT_ROOT.with_name("shakespeare_char_tokens")
HF_GPT2 = ["data=text", "task=language_model", "model=hf", "model.model_type=gpt2", "+model.config.n_layer=2"]
HF_GPT2 += ["+model.config.n_embd=64", "+model.config.n_head=4", "+model.config.n_positions=64", "data.block_size=64"]
HF_GPT2 += ["data.batch_size=32", "trainer.limit_train_batches=40"]
WORKLOADS = {
    "synthetic MLP": ["data=synthetic", "data.dataset.num_train=16384", "data.batch_size=256", "model=mlp"],
    "MNIST-1D CNN": ["data=mnist1d", "data.batch_size=128", "model=cnn"],
    "image folder CNN": IMAGE_CNN,
    # The same with the worker's core left to it: PyTorch's default pool (a thread per core) spins on the core the
    # worker loads on.
    "image folder CNN, 1 thread": [*IMAGE_CNN, "trainer.cpu_threads=1"],
    # The same with hydraloop running the transforms' closing ToDtype and Normalize per sample, as the hand-written loop
    # does: the cost of the loop itself at equal work. (The other rows run hydraloop as it ships: those two per batch.)
    "1 thread, Normalize per sample": [*IMAGE_CNN, "trainer.cpu_threads=1"],
    "128px files, 1 thread": [*IMAGE_CNN, "trainer.cpu_threads=1", f"data.dataset.root={LARGER_FILES}"],
    # experiment=text_gpt's character-level GPT (0.35M parameters, 32 x 64 tokens per step), 40 steps an "epoch".
    "GPT": ["experiment=text_gpt", "model.dropout=0", "trainer.limit_train_batches=40"],
    # The same with dropout 0.1: hydraloop's masks are keyed by sample (hydraloop.keyed_dropout), the hand-written
    # loop's are drawn from the generator, as nn.Dropout draws them.
    "GPT, dropout": ["experiment=text_gpt", "trainer.limit_train_batches=40"],
    # The GPT fed dict batches ({"idx": tokens, "labels": next tokens}): the task calls model(idx=...), the
    # hand-written loop does the same with its own dict loader.
    "GPT, dict batches": ["experiment=text_gpt", "model.dropout=0", "trainer.limit_train_batches=40"],
    # The GPT with callbacks=[ema], against a hand-written loop updating its own average with the same foreach
    # kernel after each step: the ratio is the callback's overhead, the row against "GPT" the average's cost.
    "GPT, EMA": ["experiment=text_gpt", "model.dropout=0", "trainer.limit_train_batches=40", "callbacks=[ema]"],
    # experiment=nanogpt_shakespeare_char_cpu on memory-mapped token files, random windows, clipping; against
    # nanoGPT's own way: torch.randint offsets into the np.memmap, stacked by get_batch.
    "nanoGPT recipe, token file": [
        "experiment=nanogpt_shakespeare_char_cpu",
        f"data.dataset.dir={TOKEN_DIR}",
        "trainer.limit_train_batches=40",
    ],
    # A transformers GPT-2 (model=hf, 2 layers of 64, 32 x 64 characters a step), without dropout: the same model
    # in both loops; the hand-written loop reads the logits from its output, as the task does.
    "HF GPT-2": [*HF_GPT2, "+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0", "+model.config.attn_pdrop=0"],
    # GPT-2's own dropout (0.1): hydraloop's keyed masks and attention against transformers' model as it ships
    # (nn.Dropout, and dropout inside torch's fused attention), which is what a hand-written loop would train.
    "HF GPT-2, dropout": HF_GPT2,
}
DICT_BATCHES = {"GPT, dict batches"}
SMOKE_BATCHES = 2  # --smoke's epoch: the test of the benchmark runs every section's code, at the least work


def smoke_overrides(args) -> list[str]:
    """A workload's extra overrides under --smoke: epochs of SMOKE_BATCHES batches."""
    return [f"trainer.limit_train_batches={SMOKE_BATCHES}"] if args.smoke else []


class AsDicts(Dataset):
    """(x, y) samples as {"idx": x, "labels": y}: a workload's data as dict batches."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.dataset[index]
        return {"idx": x, "labels": y}


def datasets(cfg, dict_batches: bool):
    train_set, val_set = instantiate(cfg.data.dataset)
    return (AsDicts(train_set), AsDicts(val_set)) if dict_batches else (train_set, val_set)


PER_SAMPLE_TAIL = {"1 thread, Normalize per sample"}  # workloads whose hydraloop loader runs no transform per batch


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=[*overrides, "output_dir=/unused", "log_file=/unused"])


def hydraloop_epoch(cfg, device: torch.device, elementwise_per_batch: bool = True, dict_batches: bool = False):
    """hydraloop's own loop, built from the config as src/train.py builds it; returns a function running 1 epoch."""
    strategy = SingleDevice(str(device))
    strategy.setup()
    torch.set_num_threads(cfg.trainer.cpu_threads or DEFAULT_THREADS)  # as configure_backends in src/train.py
    train_set, val_set = datasets(cfg, dict_batches)
    loader, _ = build_loaders(
        train_set,
        val_set,
        global_batch_size=cfg.data.batch_size,
        global_val_batch_size=cfg.data.batch_size,
        rank=0,
        world_size=1,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        drop_last=True,
        device=device,
        on_device=cfg.data.on_device,
        limit_train_batches=cfg.trainer.limit_train_batches,
        elementwise_per_batch=elementwise_per_batch,
    )
    torch.manual_seed(cfg.seed)
    model = strategy.wrap(instantiate(cfg.model))
    optimizer = build_optimizer(cfg.optimizer, strategy.unwrap(model))
    trainer = Trainer(
        strategy,
        NullRunWriter(),
        Precision(cfg.trainer.precision, device),
        instantiate(cfg.task),
        cfg.trainer,
        model=model,
        optimizers={"": optimizer},
        schedulers={"": instantiate(cfg.scheduler)(optimizer, total_steps=10**9, steps_per_epoch=len(loader))},
        throughput=Throughput(),
        seed=cfg.seed,
        optimized_metric=cfg.optimized_metric,
        optimized_metric_mode=cfg.optimized_metric_mode,
        config={},
        global_batch_size=cfg.data.batch_size,
        callbacks=build_callbacks(cfg.callbacks),
    )
    epochs = itertools.count()

    def epoch() -> int:
        loader.set_epoch(next(epochs))
        state = TrainState()
        trainer.train_epoch(loader, state)
        return state.epoch_samples

    return epoch


def get_batches(cfg, device: torch.device):
    """nanoGPT's get_batch: B offsets from torch.randint, each window copied out of the np.memmap and stacked."""
    meta = json.loads((Path(cfg.data.dataset.dir) / "meta.json").read_text())
    data = np.memmap(Path(cfg.data.dataset.dir) / "train.bin", dtype=meta["dtype"], mode="r")
    block, batch = cfg.data.block_size, cfg.data.batch_size

    def batches():
        while True:
            starts = torch.randint(len(data) - block, (batch,)).tolist()
            x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in starts])
            y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in starts])
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    return batches()


def handwritten_epoch(cfg, device: torch.device, dict_batches: bool = False):
    """What a researcher writes by hand: a shuffling DataLoader (or nanoGPT's get_batch for token files), forward,
    backward, clipping when the recipe clips, step."""
    torch.set_num_threads(cfg.trainer.cpu_threads or DEFAULT_THREADS)
    if cfg.data.dataset._target_.endswith("load_tokens"):
        return _handwritten_epoch(cfg, device, get_batches(cfg, device), cfg.trainer.limit_train_batches, False)
    train_set, _ = datasets(cfg, dict_batches)
    if isinstance(train_set, SeededAugmentation):
        train_set = train_set.dataset  # the plain ImageFolder: crops drawn from each worker's own stream
    workers = cfg.data.num_workers
    loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=device.type == "cuda",
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    steps = min(len(loader), cfg.trainer.limit_train_batches or len(loader))
    return _handwritten_epoch(cfg, device, loader, steps, dict_batches)


def _handwritten_epoch(cfg, device: torch.device, loader, steps: int, dict_batches: bool):
    torch.manual_seed(cfg.seed)
    plain = {"keyed_dropout": False} if cfg.model._target_.endswith("hf_model") else {}  # transformers' own dropout
    model = instantiate(cfg.model, **plain).to(device)
    optimizer = build_optimizer(cfg.optimizer, model)  # the recipe's parameter groups, as nanoGPT builds its own
    clip = cfg.trainer.grad_clip_norm
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.trainer.precision))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    ema = cfg.callbacks.get("ema")
    if ema:
        params = [param for param in model.parameters() if param.requires_grad]
        average = [param.detach().clone() for param in params]

    def epoch() -> int:
        model.train()
        for batch in itertools.islice(loader, steps):
            if dict_batches:
                batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
                targets = batch.pop("labels")
            else:
                inputs, targets = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                outputs = model(**batch) if dict_batches else model(inputs)
                outputs = getattr(outputs, "logits", outputs)  # a transformers model's output holds them
                # (N, classes) and (N,), or a language model's (B, T, vocab) and (B, T): one call for both.
                loss = F.cross_entropy(outputs.flatten(0, -2), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            if ema:
                with torch.no_grad():
                    torch._foreach_lerp_(average, params, 1 - ema.decay)
        return steps * cfg.data.batch_size

    return epoch


def timed(epoch, device: torch.device, epochs: int = 1) -> float:
    """Samples per second over `epochs` epochs (synchronised at the end on CUDA: the loop itself never waits)."""
    start = time.perf_counter()
    samples = sum(epoch() for _ in range(epochs))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return samples / (time.perf_counter() - start)


def loading_epochs(loader):
    """A function that loads one epoch of `loader`, a new permutation each call; returns the samples loaded."""
    epochs = itertools.count()

    def epoch() -> int:
        loader.set_epoch(next(epochs))
        return sum(count_rows(batch) for batch in loader)

    return epoch


def chosen_device(device: str) -> torch.device:
    """`--device`: auto (CUDA where there is one), cpu, cuda or cuda:N."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def report_header(device: torch.device, precision: str) -> dict:
    """What a benchmark's JSON report says first: the machine, the precision and the date."""
    return {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(),
        },
        "precision": precision,
        "date": time.strftime("%Y-%m-%d"),
    }
