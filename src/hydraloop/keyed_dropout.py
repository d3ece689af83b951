"""Dropout whose mask depends on which sample it is applied to, not on how the batch was split.

nn.Dropout draws its mask from a generator: each DDP rank draws for its own shard, and a micro-batch for itself, so
the masks, and the trained weights, depend on the world size and on `trainer.grad_accum_steps`. KeyedDropout hashes
(run seed, step, layer, the sample's row in the global batch, element) into each element's keep-or-drop: the same
sample at the same step gets the same mask whether one process or one of N ranks computes it, in one batch or in the
k-th micro-batch. Training with dropout then ends with the same weights under every strategy.

The training loop says, around each forward pass, which rows of the global batch the local batch holds
(`global_rows`); anywhere else (evaluation, a model called by hand) KeyedDropout is plain nn.Dropout.

A model that calls dropout as a function (`nn.functional.dropout`: OPT, BART, Whisper in transformers) has no layer
to replace: `key_functional_dropout(model)` keys those calls by their order in the model's forward pass, the n-th call
being a layer of its own. An activation checkpoint's recomputation runs in the backward pass, where the loop has set
no rows: `same_masks_in_recompute` (its `context_fn`) gives it the rows, step and call count the forward saw.
"""

import math
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# SplitMix64's constants as signed 64-bit integers: torch has no unsigned 64-bit arithmetic, and signed products
# wrap the same way modulo 2**64.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


_MASK64 = (1 << 64) - 1


class _Rows(threading.local):
    """Where the batch being computed sits in the global batch: a device tensor of its rows' global indices, and
    the step's key. Per thread: DataParallel's replicas compute their slices of the batch in threads of their own."""

    active = False
    rows: Tensor
    step_key: Tensor
    # Functional dropout calls so far in the forward pass of a model that keys them (key_functional_dropout), and
    # how deep in such models' forward passes this thread is; None outside them.
    calls: int | None = None
    depth = 0


_current = _Rows()
_torch_dropout = F.dropout  # torch's own, before key_functional_dropout installs the keyed one


@contextmanager
def rows_of(rows: Tensor, step_key: Tensor) -> Iterator[None]:
    """In this thread, the batch computed holds global rows `rows` (the loop's, and DataParallel's replica threads').
    The outer rows, if any, hold again after."""
    outer = (_current.active, getattr(_current, "rows", None), getattr(_current, "step_key", None))
    _current.active, _current.rows, _current.step_key = True, rows, step_key
    try:
        yield
    finally:
        _current.active, _current.rows, _current.step_key = outer


def current_rows() -> tuple[Tensor, Tensor] | None:
    """(rows, step key) of the batch this thread computes, if the training loop set them."""
    return (_current.rows, _current.step_key) if _current.active else None


def same_masks_in_recompute() -> tuple[AbstractContextManager, AbstractContextManager]:
    """An activation checkpoint's `context_fn` (torch.utils.checkpoint's with use_reentrant=False, and the composable
    checkpoint's): (the forward's context, the recomputation's). The recomputation runs in the backward pass, where
    the loop has set no rows: it sees the rows, step and functional dropout calls the forward saw where the
    checkpointed function began, and so draws the forward's keyed masks."""
    if not _current.active:
        return nullcontext(), nullcontext()
    # Copies: the loop refills its tensors for the next micro-batch before this one's backward pass.
    return nullcontext(), _as_in_forward(_current.rows.clone(), _current.step_key.clone(), _current.calls)


@contextmanager
def _as_in_forward(rows: Tensor, step_key: Tensor, calls: int | None) -> Iterator[None]:
    outer = (_current.active, _current.rows, _current.step_key, _current.calls)
    _current.active, _current.rows, _current.step_key, _current.calls = True, rows, step_key, calls
    try:
        yield
    finally:
        _current.active, _current.rows, _current.step_key, _current.calls = outer


class RowKeys:
    """The trainer's side: `with keys(step, first_row, rows)` around a micro-batch's forward pass.

    A rank's local row j is global row `rank + world_size * j` of the step's global batch: the training sampler
    deals the global batch's samples to the ranks in turn (DistributedSampler). A micro-batch starting at local row
    `first_row` continues that count.
    """

    def __init__(self, seed: int, rank: int, world_size: int, device: torch.device) -> None:
        self.seed_key = int(np.random.SeedSequence([seed, 0x6B657965]).generate_state(1, np.uint64)[0])
        self.rank, self.world_size, self.device = rank, world_size, device
        self.step_key = torch.zeros((), dtype=torch.int64, device=device)
        self.local_rows = self.global_rows = torch.empty(0, dtype=torch.int64, device=device)

    def __call__(self, step: int, first_row: int, rows: int, pass_index: int = 0):  # -> context manager
        """`pass_index`: with several optimizers, the pass of the step (each draws masks of its own)."""
        if len(self.local_rows) != rows:
            self.local_rows = torch.arange(rows, dtype=torch.int64, device=self.device)
            self.global_rows = torch.empty_like(self.local_rows)
        # No host-to-device copy: a fill and a multiply-add with Python numbers as kernel arguments.
        self.step_key.fill_(mix_int(self.seed_key + step + (pass_index << 40)))
        torch.add(self.local_rows * self.world_size, self.rank + self.world_size * first_row, out=self.global_rows)
        return rows_of(self.global_rows, self.step_key)


class KeyedDropout(nn.Module):
    """nn.Dropout(p) with a mask that is a function of (seed, step, `key`, global row, element) in training (see the
    module docstring). `key` tells a model's dropout layers apart: give each its own."""

    def __init__(self, p: float, key: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p}: must be in [0, 1)")
        self.p, self.key = p, key
        self.key_term = mix_int(key)  # tells the layers' masks apart

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return keyed_dropout(x, self.p, self.key_term)

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key}"


def has_plain_dropout(model: nn.Module) -> bool:
    """Whether `model` draws dropout masks from torch's generator: an nn.Dropout (or Dropout2d, AlphaDropout...)
    with p > 0, whose masks differ between a whole batch, its micro-batches and its ranks' shards."""
    return any(
        isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training
        for module in model.modules()
    )


def draws_keyed_masks(model: nn.Module) -> bool:
    """Whether the loop must say which rows a batch holds: the model has a KeyedDropout, or a module that calls
    `keyed_dropout` itself and says so with a `keyed_dropout_key` (models/hf_keyed_dropout.py's attention)."""
    return any(isinstance(module, KeyedDropout) or hasattr(module, "keyed_dropout_key") for module in model.modules())


def keyed_dropout(x: Tensor, p: float, key_term: int) -> Tensor:
    """Dropout of `x` (rows first, or rows times tokens) in training: keyed by the loop's rows where it set them,
    else plain F.dropout. `key_term` is `mix_int` of the layer's key (KeyedDropout's; models/hf_keyed_dropout.py's
    for attention weights; the call's for functional dropout)."""
    keys = current_rows()
    if keys is None or not len(keys[0]):  # none set; or a micro-batch of no rows, which a model ran as a dummy row
        return _torch_dropout(x, p, training=True)
    rows, step_key = keys
    shape = x.shape
    if shape[0] != len(rows):  # a model that flattened (rows, tokens) into one dimension: OPT's feed-forward
        if shape[0] % len(rows):
            raise ValueError(
                f"keyed dropout of a tensor of shape {tuple(shape)}: its first dimension is neither the batch's "
                f"{len(rows)} rows nor a multiple of them"
            )
        shape = (len(rows), shape[0] // len(rows), *shape[1:])
    keep = keep_mask(shape if len(shape) > 1 else (*shape, 1), p, rows, layer_key(step_key, key_term))
    # Zeroed, then scaled in place: no float copy of the mask, and the backward pass saves only the boolean one.
    return torch.where(keep.view(x.shape), x, 0.0).mul_(1.0 / (1.0 - p))


# Each 64-bit hash decides _LANES neighbours along the last dimension, one 16-bit lane each: element t takes lane
# t % _LANES of hash t // _LANES (the lanes in memory order, the same on every little-endian device: x86, ARM,
# CUDA). A quarter of the hashing that one hash per element costs, and no uniforms in float: each lane is compared
# with an integer threshold.
_LANES = 4
_LANE_BITS = 64 // _LANES


def layer_key(step_key: Tensor, key_term: int) -> Tensor:
    """The key of a layer's masks at the step: `keep_mask`'s `layer_step_key`."""
    return step_key * _GOLDEN + key_term


def keep_mask(shape: tuple[int, ...], p: float, rows: Tensor, layer_step_key: Tensor, first: int = 0) -> Tensor:
    """Whether each element of a tensor of `shape` (rows first, at least two dimensions) is kept: with probability
    1 - p to within 2**-16. `first`: the tensor is a slice of a larger one along its second-to-last dimension (a block
    of attention's queries, hydraloop.keyed_attention), starting there; its elements are kept as the larger one's."""
    # An element's key is hashed from its coordinates one dimension at a time, not from its offset in the row: the
    # token at position t of a sample gets the same mask however long the batch is padded (each rank and each
    # micro-batch pads to its own longest sample), in the last dimension too (attention's keys): lanes are picked
    # by coordinate. The hashes before the last dimension are small tensors.
    keys = _mix_(rows + layer_step_key)
    for dim, size in enumerate(shape[1:-1], start=1):
        start = first if dim == len(shape) - 2 else 0
        coordinates = torch.arange(start, start + size, dtype=torch.int64, device=rows.device)
        keys = _mix_(keys[..., None] + coordinates * _GOLDEN)
    size = shape[-1]
    groups = torch.arange(-(-size // _LANES), dtype=torch.int64, device=rows.device) * _GOLDEN
    lanes = _mix_(keys[..., None] + groups).view(torch.int16)[..., :size]
    # A lane as an unsigned u in [0, 2**16) keeps its element where u >= p * 2**16; as a signed one, where it is at
    # least that threshold less 2**15. The threshold stays an int16: a p above 1 - 2**-16 keeps 2**-16 (not none).
    threshold = min(math.ceil(p * 2**_LANE_BITS), 2**_LANE_BITS - 1) - 2 ** (_LANE_BITS - 1)
    return lanes >= threshold


def key_functional_dropout(model: nn.Module) -> None:
    """`model`'s calls of `torch.nn.functional.dropout` (its own, and its modules') draw keyed masks: the n-th call in
    its forward pass is keyed as a layer of its own. torch's function is replaced by one that is torch's own outside
    such a forward pass (in any thread: DataParallel's replicas count in theirs), and outside the loop's rows."""
    if F.dropout is not _dropout_keyed_by_call:
        F.dropout = _dropout_keyed_by_call  # models look it up when they call it (nn.functional.dropout, F.dropout)
    model.register_forward_pre_hook(_count_calls)
    model.register_forward_hook(_stop_counting_calls, always_call=True)


def _count_calls(module: nn.Module, args: tuple) -> None:
    if _current.depth == 0:  # a model that keys its calls, called inside another, counts on from the outer's
        _current.calls = 0
    _current.depth += 1


def _stop_counting_calls(module: nn.Module, args: tuple, outputs: object) -> None:
    _current.depth -= 1
    if _current.depth == 0:
        _current.calls = None


def _dropout_keyed_by_call(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """torch.nn.functional.dropout, keyed in the forward pass of a model that asked for it, where the loop set the
    rows (or a checkpoint's recomputation of it); torch's own anywhere else."""
    calls = _current.calls
    if calls is None or not _current.active or not training or not 0.0 < p < 1.0:
        return _torch_dropout(input, p, training, inplace)
    _current.calls = calls + 1
    dropped = keyed_dropout(input, p, mix_int(2 << 40 | calls))  # apart from KeyedDropout's and attention's keys
    return input.copy_(dropped) if inplace else dropped


def _mix_(z: Tensor) -> Tensor:
    """SplitMix64's finaliser (Steele et al. 2014) in place on `z` (a tensor of the caller's making), with logical
    right shifts made from arithmetic ones. In place, into one scratch tensor: no allocation per operation."""
    shifted = torch.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, 1)):
        torch.bitwise_right_shift(z, shift, out=shifted)
        z ^= shifted.bitwise_and_((1 << 64 - shift) - 1)
        if multiplier != 1:
            z *= multiplier
    return z


def mix_int(z: int) -> int:
    """`_mix_` of one Python integer, as a signed 64-bit value: the step's key, computed on the host."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * _MIX1) & _MASK64
    z ^= z >> 27
    z = (z * _MIX2) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z
