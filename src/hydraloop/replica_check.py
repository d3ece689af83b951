"""`trainer.replica_check_every_n_steps`: the ranks that hold copies of the same values still hold the same bits.

Under ddp every rank holds the whole model, its optimizers' state and its callbacks' state; under fsdp with
`parallel.replicate` (HSDP) the ranks at the same place of each replicate group hold the same shards. They stay equal
as long as everything that changes them comes from the all-reduced gradient, so a difference is the mark of a
computation that depends on the rank outside it (a weight rescaled from the rank's own batch, an optimizer or
callback that reads rank-local values) or of an exactness bug in the loop itself. Megatron-LM compares SHA-1 digests
of the parameters, computed on the CPU, across its data-parallel replicas at an interval
(check_param_hashes_across_dp_replicas); here every tensor is digested where it lives, and one all-reduce of two
numbers per rank compares them all.

A tensor's digest is the sum of its bytes, read as 32-bit integers, times odd position weights, modulo 2**32 (torch's
integer arithmetic wraps): exact, and independent of the order a kernel sums in. A single element that differs by any
number of bits (one ulp) changes it, since an odd weight is invertible modulo 2**32; so does an exchange of two
elements (`tensor_digest`). It costs two elementwise passes over the state: on the CPU, about a third of one AdamW
training step of the same MLP, paid once per checkpoint at the default.

What is compared: the parameters, each optimizer's state (moments, step counts) and hyperparameters, and each
callback's `state_dict` (EMA's averages). Not the buffers, which every rank takes from rank 0 before each validation
and checkpoint, nor the random generators' states, which are per rank by design.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from hydraloop.errors import TrainingDiverged

if TYPE_CHECKING:
    from hydraloop.callbacks import TrainerView
    from hydraloop.parallel.single import SingleDevice

CHUNK = 1 << 22  # words digested at once: the weights and the products of the largest tensor, 16 MiB each
MASK = (1 << 64) - 1


class ReplicasDiverged(TrainingDiverged):
    """Ranks that hold copies of the same values hold different ones. The message names the first tensor that
    differs, the step and the ranks; no checkpoint is made of that state."""


class ReplicaCheck:
    """Compares the replicated state across the ranks that hold copies of it, at the moments the loop calls it.

    `every_n_steps`: null, before each validation and checkpoint (and so at the end); N, also after every N-th
    optimizer step; 0, never. The strategy says which ranks hold each copy (`replica_groups`).
    """

    def __init__(self, every_n_steps: int | None, strategy: SingleDevice) -> None:
        self.every_n_steps = every_n_steps
        # A rank alone in its group has nothing to compare: single, dataparallel, plain fsdp.
        self.groups = [group for group in strategy.replica_groups() if len(group) > 1]
        self.rank = strategy.rank
        self.enabled = every_n_steps != 0 and bool(self.groups)
        self.checked_at = -1  # the global step of the last check, which passed

    def after_step(self, trainer: TrainerView, step: int) -> None:
        """After each optimizer step: every N-th step with `every_n_steps=N`."""
        if self.enabled and self.every_n_steps and step % self.every_n_steps == 0:
            self(trainer, step)

    def __call__(self, trainer: TrainerView, step: int) -> None:
        """Every rank calls it at the same moment (before a validation or checkpoint, and at the end): one
        all-reduce and one host sync; on a difference, every rank raises ReplicasDiverged."""
        if not self.enabled or self.checked_at == step:
            return
        strategy = trainer.strategy
        entries = list(replicated_state(trainer))
        names = [name for name, _ in entries]
        digests = [digest(value, strategy.device) for _, value in entries]
        # Each rank's [entry count, digest of every entry and its name at its position], side by side: the sum over
        # ranks of rows that only their own rank fills (an all-gather, through the strategy's one reduction).
        table = torch.zeros((strategy.world_size, 2), dtype=torch.int64, device=strategy.device)
        table[self.rank, 0] = len(names)
        table[self.rank, 1] = combined(names, digests, strategy.device)
        rows = strategy.all_reduce(table).tolist()  # the one host sync
        if all(len({tuple(rows[rank]) for rank in group}) == 1 for group in self.groups):
            self.checked_at = step
            return
        raise ReplicasDiverged(self._first_difference(names, digests, step) + f"; {trainer.rerun_note()}")

    def _first_difference(self, names: list[str], digests: list[Tensor | int], step: int) -> str:
        """The line that names the first entry (in the order of `replicated_state`) whose digest differs within a
        group, and the ranks; the same on every rank. Gathers every rank's names and digests: on a mismatch only."""
        device_digests = [value for value in digests if isinstance(value, Tensor)]
        on_device = iter(torch.stack(device_digests).tolist() if device_digests else [])
        local = [value if isinstance(value, int) else next(on_device) for value in digests]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(zip(names, local)))
        agreed = f" (they agreed at step {self.checked_at})" if self.checked_at >= 0 else ""
        for group in self.groups:
            first, *others = group
            reference = gathered[first]
            for position in range(max(len(gathered[rank]) for rank in group)):
                entry = reference[position] if position < len(reference) else None
                differ = [rank for rank in others if _at(gathered[rank], position) != entry]
                if differ:
                    name = entry[0] if entry else gathered[differ[0]][position][0]
                    ranks = ", ".join(map(str, differ))
                    return (
                        f"the replicas diverged by step {step}{agreed}: {name} on rank{'s' * (len(differ) > 1)} "
                        f"{ranks} differs from rank {first}'s: something changed it outside the all-reduced gradient "
                        "(a rank-dependent update in the model, an optimizer or a callback)"
                    )
        raise AssertionError("the replicas' digests differ, and none of their entries does")  # the same inputs


def replicated_state(trainer: TrainerView) -> Iterator[tuple[str, Any]]:
    """(name, value) of everything the replicas must agree on, the same names in the same order on every rank:
    parameters, then each optimizer's hyperparameters and per-parameter state, then each callback's state."""
    model = trainer.strategy.unwrap(trainer.model)
    named = list(model.named_parameters())
    for name, param in named:
        yield f"model.{name}", param  # each name the path of that value in a checkpoint
    name_of = {param: name for name, param in named}
    for optimizer_name, optimizer in trainer.optimizers.items():
        prefix = f"optimizer.{optimizer_name}" if optimizer_name else "optimizer"
        for index, group in enumerate(optimizer.param_groups):
            for key in sorted(key for key in group if key != "params"):
                yield from _leaves(f"{prefix}.param_groups[{index}].{key}", group[key])
            for param in group["params"]:
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    # Each tensor of a state held in lists or dicts (LBFGS's history, a preconditioner's factors)
                    # compared as one: a container's printed form shows 4 decimals and a big tensor's corners.
                    yield from _leaves(f"{prefix}.state[{name_of.get(param, '?')}].{key}", value)
    for callback_name, callback in trainer.callbacks.items():
        yield from _leaves(f"callbacks.{callback_name}", callback.state_dict(trainer))


def digest(value: Any, device: torch.device) -> Tensor | int:
    """A tensor on `device`: its digest there, a 0-dim int32 tensor (no host sync). Anything else (a number, a
    string, a tensor elsewhere: the CPU step count of an optimizer on a GPU): its digest as a Python int."""
    if isinstance(value, Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value  # an FSDP shard: this rank's part
        if local.device == device:
            return tensor_digest(local)
        return _signed(int(tensor_digest(local).item()))
    if isinstance(value, bool | int):
        return _signed(int(value))
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return _signed(zlib.crc32(repr(value).encode()))  # str, None; repr is the same in every process, hash() is not


@torch.no_grad()
def tensor_digest(tensor: Tensor) -> Tensor:
    """sum(words[i] * (2 i + 1)) mod 2**32 over the tensor's bytes in memory order read as 32-bit integers, on its
    device: a 0-dim int32. A 32-bit element is one word, a float64 two, two bfloat16s one (an odd number of 1- or
    2-byte elements: one word each). An element that differs by any bits changes its words by less than 2**32, and
    an odd weight is invertible modulo 2**32: the digest changes. Several elements that differ: a chance of 2**-32
    that it does not. 32-bit integer arithmetic wraps and is vectorised everywhere; 64-bit multiplication is not on
    most CPUs (about 4 times slower)."""
    words = _words(tensor.detach().reshape(-1))
    total = torch.zeros((), dtype=torch.int32, device=tensor.device)
    for start in range(0, words.numel(), CHUNK):
        chunk = words[start : start + CHUNK]
        weights, products = _workspace(chunk.numel(), chunk.device)
        total += torch.mul(chunk, weights, out=products).sum(dtype=torch.int32)
        if start:  # the weights are 2 i + 1 from this chunk's start: 2 * start more for each of its words
            total += chunk.sum(dtype=torch.int32) * (2 * start)
    return total


def _words(flat: Tensor) -> Tensor:
    """The bytes of a flat, contiguous tensor as int32: the same memory when it divides into words, else a copy with
    one element a word."""
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.numel() * flat.element_size() % 4 == 0:
        return flat.view(torch.int32)
    return flat.view({1: torch.uint8, 2: torch.int16}[flat.element_size()]).to(torch.int32)


_WORKSPACES: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _workspace(count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The weights 1, 3, 5, ... and room for the products, `count` (at most CHUNK) of each, as int32 on `device`:
    made once per device, and again only for a longer tensor. Fresh temporaries would cost more than the arithmetic
    on the CPU, where each large allocation is new memory to fault in."""
    weights, products = _WORKSPACES.get(device, (None, None))
    if weights is None or len(weights) < count:
        weights = torch.arange(1, 2 * count + 1, 2, dtype=torch.int32, device=device)
        products = torch.empty_like(weights)
        _WORKSPACES[device] = weights, products
    return weights[:count], products[:count]


def combined(names: list[str], digests: list[Tensor | int], device: torch.device) -> Tensor:
    """One digest of all entries, each weighted by its (odd) position, with its name's: ranks that hold other entries
    (a state another rank lacks) differ here too. The host's part is added as a scalar: no copy to the device."""
    on_host = 0
    on_device = []
    for position, (name, value) in enumerate(zip(names, digests)):
        weight = 2 * position + 1
        on_host += (zlib.crc32(name.encode()) + (value if isinstance(value, int) else 0)) * weight
        if isinstance(value, Tensor):
            on_device.append(value.to(torch.int64) * weight)
    total = torch.stack(on_device).sum() if on_device else torch.zeros((), dtype=torch.int64, device=device)
    return total + _signed(on_host)


def _leaves(prefix: str, state: Any) -> Iterator[tuple[str, Any]]:
    """The values of a nested state (dicts, lists, sets), each named by its path. A set's order is its process's
    string hashes' (PYTHONHASHSEED differs between processes): its items are taken in the order of their printed
    forms, the same in every process."""
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from _leaves(f"{prefix}.{key}", state[key])
    elif isinstance(state, list | tuple):
        for index, item in enumerate(state):
            yield from _leaves(f"{prefix}[{index}]", item)
    elif isinstance(state, set | frozenset):
        for index, item in enumerate(sorted(state, key=repr)):
            yield from _leaves(f"{prefix}{{{index}}}", item)
    else:
        yield prefix, state


def _at(entries: list, position: int) -> Any:
    return entries[position] if position < len(entries) else None


def _signed(value: int) -> int:
    """`value` modulo 2**64, as the int64 that holds those bits."""
    value &= MASK
    return value - (1 << 64) if value >= 1 << 63 else value
