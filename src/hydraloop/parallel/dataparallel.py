"""`parallel=dataparallel`: one process; nn.DataParallel splits each batch over several GPUs."""

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from hydraloop.batches import count_rows, tensors
from hydraloop.errors import ConfigError
from hydraloop.optim import optimizer_nodes, part_modules
from hydraloop.parallel.single import SingleDevice, resolve_device
from hydraloop.row_keys import current_rows, rows_of

log = logging.getLogger(__name__)


class DataParallelStrategy(SingleDevice):
    """One process; nn.DataParallel scatters each batch over several GPUs and gathers the outputs on the first.

    The loop still sees one process with the whole global batch, so sampling and metrics are those of `single`.
    Its replicas are copies of the one model made anew at each forward and never stepped, so there is one copy of
    the trained state, as under `single` (`replica_groups`: nothing for hydraloop.replica_check to compare).
    """

    def __init__(self, device: str = "auto", device_ids: list[int] | None = None) -> None:
        super().__init__(device)
        self.requested_ids = list(device_ids) if device_ids is not None else None
        self.device_ids: list[int] = []

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        if part_modules(cfg.get("optimizer")):  # a task calls the parts, which DataParallel's one wrapper cannot split
            raise ConfigError(
                f"optimizer: several optimizers ({', '.join(optimizer_nodes(cfg.optimizer))}) train with "
                "parallel=single, ddp or fsdp; not dataparallel"
            )
        split_over = gpus_to_split_over(self.device_name, self.requested_ids)
        if cfg.trainer.compile and len(split_over) > 1:
            # Module.compile binds the compiled forward to the module it was called on; DataParallel's replicas copy
            # that binding, so every replica would run the original on the first GPU's weights.
            raise ConfigError(
                f"trainer.compile=true: parallel=dataparallel over GPUs {split_over} would run the first GPU's "
                "compiled module on every replica; use parallel=ddp (one process per GPU), which compiles"
            )

    def setup(self) -> None:
        super().setup()
        self.device_ids = gpus_to_split_over(self.device_name, self.requested_ids)
        if self.device_ids:
            self.device = torch.device("cuda", self.device_ids[0])  # DataParallel gathers on the first id
            torch.cuda.set_device(self.device)

    @property
    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", index) for index in self.device_ids] if len(self.device_ids) > 1 else [self.device]

    def wrap(self, model: nn.Module, parts: Sequence[str] = ()) -> nn.Module:
        model = super().wrap(model)
        if len(self.device_ids) < 2:
            log.warning(
                "parallel=dataparallel needs at least 2 GPUs, found %d: training like parallel=single",
                len(self.device_ids),
            )
            return model
        return AutocastDataParallel(model, device_ids=self.device_ids)


def gpus_to_split_over(device: str, device_ids: Sequence[int] | None) -> list[int]:
    """The GPUs each batch is split over, the first being where DataParallel gathers; [] on the CPU.

    `device_ids=null`: every visible GPU, starting with `device`'s (cuda:1 -> [1, 0, 2, ...]), since DataParallel
    wants the model on its first id.
    """
    first = resolve_device(device)
    if first.type != "cuda":
        return []
    visible = torch.cuda.device_count()
    if device_ids is None:
        return [first.index, *(index for index in range(visible) if index != first.index)]
    ids = list(device_ids)
    if len(set(ids)) != len(ids) or any(not 0 <= index < visible for index in ids):
        raise ConfigError(f"parallel.device_ids={ids}: must be distinct GPU indices below {visible} (the visible GPUs)")
    if ids and device.startswith("cuda:") and first.index != ids[0]:
        raise ConfigError(
            f"device={device}: DataParallel gathers on the first of parallel.device_ids={ids}; "
            f"use device=cuda:{ids[0]} or device=cuda"
        )
    return ids


class AutocastDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas compute in the caller's autocast dtype, and know their rows of the batch.

    The replicas run in threads, and parallel_apply re-enters autocast there without a dtype. The autocast dtype is
    per thread, and a new thread has the default one (float16 on CUDA): a bf16 run would compute in float16 with no
    loss scaling (torch 2.13). Each replica enters the caller's autocast once more, inside its thread. Likewise each
    is told which global rows its slice of the batch holds, for KeyedDropout (hydraloop.keyed_dropout).
    """

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        replicas = keyed_replicas(replicas, inputs, kwargs)
        return super().parallel_apply(autocast_replicas(replicas, self.src_device_obj.type), inputs, kwargs)


def autocast_replicas(replicas: Sequence[Callable[..., Any]], device_type: str) -> list[Callable[..., Any]]:
    """`replicas`, each called under the autocast state of the calling thread (unchanged if autocast is off)."""
    if not torch.is_autocast_enabled(device_type):
        return list(replicas)
    dtype = torch.get_autocast_dtype(device_type)
    return [partial(_call_in_autocast, replica, device_type, dtype) for replica in replicas]


def keyed_replicas(
    replicas: Sequence[Callable[..., Any]], inputs: Sequence[Any], kwargs: Sequence[Any] | None = None
) -> list[Callable[..., Any]]:
    """`replicas`, each called with the global rows of its slice of the batch (DataParallel scatters the batch's
    rows in order, positional and keyword inputs alike), if the training loop set the batch's rows in this thread."""
    keys = current_rows()
    if keys is None:
        return list(replicas)
    rows, step_key = keys
    kwargs = kwargs or [{} for _ in inputs]
    sizes = [count_rows((args, given)) for args, given in zip(inputs, kwargs)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        partial(_call_with_rows, replica, rows[start : start + size], step_key)
        for replica, start, size in zip(replicas, starts, sizes)
    ]


def _call_with_rows(replica: Callable[..., Any], rows: torch.Tensor, step_key: torch.Tensor, *args, **kwargs) -> Any:
    device = next(tensor for _, tensor in tensors((args, kwargs))).device
    with rows_of(rows.to(device), step_key.to(device)):
        return replica(*args, **kwargs)


def _call_in_autocast(
    replica: Callable[..., Any], device_type: str, dtype: torch.dtype, *args: Any, **kwargs: Any
) -> Any:
    with torch.autocast(device_type, dtype=dtype):
        return replica(*args, **kwargs)
