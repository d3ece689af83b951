import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from hydraloop.batches import slice_rows
from hydraloop.errors import ConfigError
from hydraloop.sharded_checkpoint import in_memory

T = TypeVar("T")


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """`auto`: this rank's GPU if there is one, else the CPU. `cuda` without an index: this rank's GPU, the one at its
    local rank; or, where the launcher binds one GPU to each task (SLURM's --gpus-per-task, a CUDA_VISIBLE_DEVICES
    per process), the only one the rank sees, whatever its local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device}: not a device (use auto, cpu, cuda or cuda:N)") from None
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device}: CUDA is not available on this machine")
    visible = torch.cuda.device_count()
    if resolved.index is not None:
        if resolved.index >= visible:
            raise ConfigError(f"device={device}: only {visible} GPU(s) visible")
        return resolved
    if local_rank < visible:
        return torch.device("cuda", local_rank)
    # One GPU in view, and a launcher that chose which (CUDA_VISIBLE_DEVICES): it is this rank's own. Without that
    # variable every rank sees the same GPUs, and taking GPU 0 would put two ranks on it.
    if visible == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return torch.device("cuda", 0)
    raise ConfigError(
        f"device={device}: this rank (LOCAL_RANK={local_rank}) has no GPU of its own, only {visible} GPU(s) visible; "
        "start at most one process per GPU, or bind one GPU to each (CUDA_VISIBLE_DEVICES)"
    )


class SingleDevice:
    """One process on one device. The base of the other strategies: each overrides only what it changes."""

    world_size = 1
    rank = 0
    local_rank = 0

    def __init__(self, device: str = "auto") -> None:
        self.device_name = device
        resolve_device(device)  # a bad device fails in the launcher, before any rank starts

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def check(self, cfg: Any) -> None:
        """What this strategy needs of the rest of the config and of its launcher; in the launcher, before any rank
        starts (under torchrun or SLURM, in every rank)."""
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and launched != self.world_size:  # each process would be a rank 0 writing the run directory
            raise ConfigError(
                f"WORLD_SIZE={launched}: torchrun or hydra.launcher started {launched} processes, one rank each, but "
                f"{type(self).__name__} runs one: use parallel=ddp or parallel=fsdp, or start one process"
            )

    def launch(self, worker: Callable[..., T], *args) -> T:
        """Runs `worker` in every rank and returns rank 0's result; here, in this process."""
        return worker(*args)

    def setup(self) -> None:
        """Called first in each rank: pick the device (and, in subclasses, join the process group)."""
        self.device = resolve_device(self.device_name, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def devices(self) -> list[torch.device]:
        """Every device this process computes on (after `setup`): its generators are reseeded before each step."""
        return [self.device]

    def build(self, make_model: Callable[[], nn.Module]) -> nn.Module:
        """The model as this rank builds it, for `wrap`: here, whole, on the CPU. (FSDP builds it whole on rank 0
        only, and on the meta device elsewhere.)"""
        return make_model()

    def wrap(self, model: nn.Module, parts: Sequence[str] = ()) -> nn.Module:
        """The model on this rank's device, wrapped as the strategy trains it. `parts`: the submodules several
        optimizers train, one each (hydraloop.optim), whose gradients the loop has reduced by `reduce_gradients`
        before it steps their optimizer."""
        return model.to(self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, whose state_dict keys carry no wrapper prefix (`module.`): only DDP's and DataParallel's
        wrappers are taken off, never a user's own submodule that happens to be called `module`."""
        wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        return model.module if wrapped else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context for the backward passes of all micro-batches but the last: no gradient communication."""
        return nullcontext()

    def reduce_gradients(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        """After the last backward of an optimizer's pass: the gradients of `params`, the parameters it steps, as the
        mean over the ranks, where the wrapper has not made them so already. Here, one rank: they are."""

    def whole_tensor_draws(self) -> AbstractContextManager:
        """Around the parts of a step that act on the state every rank holds (the gradient hooks, clipping, the
        optimizer step, `on_optimizer_step`), whose generators are seeded alike on every rank: random numbers drawn
        there on a parameter or gradient are the ones one process draws on it. Here every rank holds each whole, and
        draws alike already: nothing to do."""
        return nullcontext()

    def eval_module(self, model: nn.Module) -> nn.Module:
        """The module to evaluate with: the wrapped one, unless the wrapper communicates in forward."""
        return model

    def eval_batches(self, batches: Iterable[Any], count: int) -> Iterable[Any]:
        """This rank's `count` validation batches, as the loop evaluates them: here, as they come."""
        return batches

    def batches_on_every_rank(self, batches: Iterable[Any], count: int) -> Iterator[Any]:
        """This rank's `count` validation batches, and as many more empty ones as make every rank's count the same:
        for validation passes that communicate (FSDP's forward, a loss over the global batch). The validation shards
        may differ by one sample, and so by one batch; an empty batch adds nothing to the metrics."""
        counts = torch.zeros(self.world_size, device=self.device)
        counts[self.rank] = count
        counts = self.all_reduce(counts)
        most = int(counts.max())
        if most > 0 and not bool(counts.all()):
            raise ConfigError(f"the validation set has fewer samples than the {self.world_size} ranks")
        batch = None
        for batch in batches:
            yield batch
        for _ in range(most - count):
            yield slice_rows(batch, 0, 0)

    def sync_buffers(self, model: nn.Module) -> None:
        """Gives every rank rank 0's buffers (batch norm's running statistics), before a validation or checkpoint:
        each rank updates its own from its own shard, and rank 0's are saved. Here, one rank: nothing to do."""

    def reshard(self, model: nn.Module) -> None:
        """Before parameters' values are written in place outside `load_state_dict` (a callback swapping in weights
        of its own, hydraloop.callbacks.ema), on every rank: the next forward reads the model's parameters, not a
        copy an earlier forward gathered (FSDP's). Here it always does: nothing to do."""

    def state_dicts(
        self, model: nn.Module, optimizers: dict[str, Optimizer], staging: Path | None = None
    ) -> Callable[[], tuple[Any, dict[str, dict]]]:
        """The model's and each optimizer's state (by name) for a checkpoint, as a plain model and optimizer hold it.

        A function, called only where a checkpoint is written (rank 0), so other ranks copy nothing. `staging`:
        where a strategy whose ranks write their own shards writes them (FSDP; hydraloop.sharded_checkpoint).
        """
        return lambda: (
            self.unwrap(model).state_dict(),
            {name: optimizer.state_dict() for name, optimizer in optimizers.items()},
        )

    def wait_for_checkpoint(self) -> None:
        """Until this rank's part of a checkpoint written in the background is on disk (FSDP's); a failed write
        raises StorageError. Here, every checkpoint is written before `state_dicts` returns: nothing to wait for."""

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Loads a checkpoint's `model` (a plain model's state_dict, or a sharded checkpoint's, read whole) into the
        wrapped model; on every rank."""
        self.unwrap(model).load_state_dict(in_memory(state))

    def load_optimizer_state(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Loads a checkpoint's `optimizer` (a plain optimizer's state_dict, or a sharded checkpoint's, read whole);
        on every rank."""
        optimizer.load_state_dict(in_memory(state))

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sums `tensor` over ranks, in place; returns it."""
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's `tensor` (of one shape on every rank), by rank; here, this one's."""
        return [tensor]

    def replica_groups(self) -> list[list[int]]:
        """The ranks that hold the same copy of the trained state (parameters, optimizer and callback states), one
        list per copy, each rank in one (hydraloop.replica_check compares them). Here, one rank: one copy."""
        return [[self.rank]]

    def teardown(self) -> None:
        pass
