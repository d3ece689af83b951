"""Where the batch being computed sits in the global batch: the key that keyed randomness is a function of.

A random number drawn per sample from a generator depends on who draws it: each DDP rank draws for its own shard,
each micro-batch for itself. Keyed randomness (hydraloop.keyed_dropout's masks, hydraloop.keyed_random's draws)
is instead a hash of (seed, step, pass, the sample's row in the global batch, a key of the caller's, the element):
the same whether one process or one of N ranks computes the sample, in one batch or in the k-th micro-batch, and
after a resume.

The training loop says, around each forward pass, which rows of the global batch the local batch holds (`RowKeys`);
validation likewise, with the samples' indices in the validation set under a key of its own. Anywhere else (a model
called by hand, `mode=predict`) `current_rows()` is None and keyed randomness falls back on torch's generators.

The rows are computed on the device only when something asks for them (`current_rows`): a run whose model and task
draw nothing keyed pays a Python context per micro-batch and no device work.
"""

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch
from torch import Tensor

# SplitMix64's constants as signed 64-bit integers: torch has no unsigned 64-bit arithmetic, and signed products
# wrap the same way modulo 2**64.
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_MASK64 = (1 << 64) - 1

# A pass index no training pass has: validation's draws are keyed apart from every step's, and are the same at every
# validation (a validation loss over drawn noise compares checkpoints on the same noise).
VALIDATION_PASS = 1 << 20


class _Rows(threading.local):
    """The rows of this thread's batch. Per thread: DataParallel's replicas compute their slices in threads of their
    own. `rows` and `step_key` are device tensors, made from `source` at the first `current_rows()` of a context."""

    active = False
    rows: Tensor | None = None
    step_key: Tensor | None = None
    source: "RowKeys | None" = None
    # Functional dropout calls so far in the forward pass of a model that keys them (keyed_dropout), and how deep in
    # such models' forward passes this thread is; None outside them.
    calls: int | None = None
    depth = 0


current = _Rows()


def current_rows() -> tuple[Tensor, Tensor] | None:
    """(rows, step key) of the batch this thread computes: the global rows as an int64 device tensor, and the
    step's key as a device scalar; None outside the loop's forward passes."""
    if not current.active:
        return None
    if current.rows is None:
        current.rows, current.step_key = current.source.materialise()
    return current.rows, current.step_key


@contextmanager
def rows_of(rows: Tensor, step_key: Tensor) -> Iterator[None]:
    """In this thread, the batch computed holds global rows `rows` (DataParallel's replica threads: their slices).
    The outer rows, if any, hold again after."""
    with _state(True, rows, step_key, None, current.calls):
        yield


_FIELDS = ("active", "rows", "step_key", "source", "calls")


@contextmanager
def _state(active: bool, rows: Tensor | None, step_key: Tensor | None, source, calls: int | None) -> Iterator[None]:
    """This thread's rows context (`_Rows`' fields, in `_FIELDS`' order) while it lasts; the outer one after."""
    outer = [getattr(current, name) for name in _FIELDS]
    _set([active, rows, step_key, source, calls])
    try:
        yield
    finally:
        _set(outer)


def _set(values: list) -> None:
    for name, value in zip(_FIELDS, values):
        setattr(current, name, value)


def same_masks_in_recompute() -> tuple[AbstractContextManager, AbstractContextManager]:
    """An activation checkpoint's `context_fn` (torch.utils.checkpoint's with use_reentrant=False, and the composable
    checkpoint's): (the forward's context, the recomputation's). The recomputation runs in the backward pass, where
    the loop has set no rows: it sees the rows, step and functional dropout calls the forward saw where the
    checkpointed function began, and so draws the forward's keyed numbers."""
    keys = current_rows()
    if keys is None:
        return nullcontext(), nullcontext()
    # Copies: the loop refills its tensors for the next micro-batch before this one's backward pass.
    rows, step_key = keys
    return nullcontext(), _state(True, rows.clone(), step_key.clone(), None, current.calls)


class RowKeys:
    """The loop's side: `with row_keys(step, first_row, rows)` around a micro-batch's forward pass.

    A rank's local row j is global row `rank + world_size * j` of the step's global batch: the training sampler
    deals the global batch's samples to the ranks in turn (DistributedSampler), and validation's shards stride the
    validation set the same way. A micro-batch starting at local row `first_row` continues that count.
    """

    def __init__(self, seed: int, rank: int, world_size: int, device: torch.device) -> None:
        self.seed_key = int(np.random.SeedSequence([seed, 0x6B657965]).generate_state(1, np.uint64)[0])
        self.rank, self.world_size, self.device = rank, world_size, device
        self.step_key = torch.zeros((), dtype=torch.int64, device=device)
        self.local_rows = self.global_rows = torch.empty(0, dtype=torch.int64, device=device)
        self.key, self.first_row, self.rows = 0, 0, 0

    def __call__(self, step: int, first_row: int, rows: int, pass_index: int = 0) -> AbstractContextManager:
        """`pass_index`: with several optimizers, the pass of the step (each draws numbers of its own);
        VALIDATION_PASS for validation, whose `first_row` counts the rank's samples so far."""
        self.key = mix_int(self.seed_key + step + (pass_index << 40))
        self.first_row, self.rows = first_row, rows
        return _state(True, None, None, self, None)

    def materialise(self) -> tuple[Tensor, Tensor]:
        """The current context's rows and step key on the device. No host-to-device copy: a fill and a multiply-add
        with Python numbers as kernel arguments."""
        if len(self.local_rows) != self.rows:
            self.local_rows = torch.arange(self.rows, dtype=torch.int64, device=self.device)
            self.global_rows = torch.empty_like(self.local_rows)
        self.step_key.fill_(self.key)
        first = self.rank + self.world_size * self.first_row
        torch.add(self.local_rows * self.world_size, first, out=self.global_rows)
        return self.global_rows, self.step_key


def mix_(z: Tensor) -> Tensor:
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
    """`mix_` of one Python integer, as a signed 64-bit value: the step's key, computed on the host."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * _MIX1) & _MASK64
    z ^= z >> 27
    z = (z * _MIX2) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z


def layer_key(step_key: Tensor, key_term: int) -> Tensor:
    """The key of a layer's (or a draw's) numbers at the step, from `key_term`, a `mix_int` of its own key."""
    return step_key * GOLDEN + key_term


def element_keys(shape: tuple[int, ...], rows: Tensor, layer_step_key: Tensor, first: int = 0) -> Tensor:
    """A well-mixed 64-bit key per element of a tensor of `shape` (rows first) except its last dimension: shape
    `shape[:-1]`. An element's key is hashed from its coordinates one dimension at a time, not from its offset in
    the row: the element at position t of a sample gets the same key however long the batch is padded (each rank and
    each micro-batch pads to its own longest sample). `first`: the tensor is a slice of a larger one along its
    second-to-last dimension, starting there (a block of attention's queries, hydraloop.keyed_attention)."""
    keys = mix_(rows + layer_step_key)
    for dim, size in enumerate(shape[1:-1], start=1):
        start = first if dim == len(shape) - 2 else 0
        coordinates = torch.arange(start, start + size, dtype=torch.int64, device=rows.device)
        keys = mix_(keys[..., None] + coordinates * GOLDEN)
    return keys
