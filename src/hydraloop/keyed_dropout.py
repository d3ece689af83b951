"""Dropout whose mask depends on which sample it is applied to, not on how the batch was split.

nn.Dropout draws its mask from a generator: each DDP rank draws for its own shard, and a micro-batch for itself, so
the masks, and the trained weights, depend on the world size and on `trainer.grad_accum_steps`. KeyedDropout hashes
(run seed, step, layer, the sample's row in the global batch, element) into each element's keep-or-drop: the same
sample at the same step gets the same mask whether one process or one of N ranks computes it, in one batch or in the
k-th micro-batch. Training with dropout then ends with the same weights under every strategy.

The training loop says, around each forward pass, which rows of the global batch the local batch holds
(hydraloop.row_keys); anywhere else (evaluation, a model called by hand) KeyedDropout is plain nn.Dropout.

A model that calls dropout as a function (`nn.functional.dropout`: OPT, BART, Whisper in transformers) has no layer
to replace: `key_functional_dropout(model)` keys those calls by their order in the model's forward pass, the n-th call
being a layer of its own. An activation checkpoint's recomputation runs in the backward pass, where the loop has set
no rows: `same_masks_in_recompute` (its `context_fn`) gives it the rows, step and call count the forward saw.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hydraloop import keyed_random
from hydraloop.row_keys import GOLDEN, current, current_rows, element_keys, layer_key, mix_, mix_int

_torch_dropout = F.dropout  # torch's own, before key_functional_dropout installs the keyed one


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


class KeyedDropPath(nn.Module):
    """Stochastic depth (timm's DropPath: a residual branch dropped for a whole sample with probability p, the kept
    ones scaled by 1 / (1 - p)), each sample's drop keyed as KeyedDropout's masks are (hydraloop.keyed_random)."""

    def __init__(self, p: float, key: int) -> None:
        super().__init__()
        self.p, self.key = p, key

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        # A batch of k entries a row (a model given each row's views side by side, as keyed dropout's masks allow):
        # each entry drawn as the row's k-th.
        keys, entries = current_rows(), x.shape[0]
        per_row = entries // len(keys[0]) if keys and len(keys[0]) and entries % len(keys[0]) == 0 else 1
        draws = (entries // per_row, per_row)
        kept = keyed_random.bernoulli(1.0 - self.p, draws, key=("drop_path", self.key), device=x.device)
        return x * kept.reshape(entries, *[1] * (x.dim() - 1)).to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key}"


def has_plain_dropout(model: nn.Module) -> bool:
    """Whether `model` draws dropout masks from torch's generator: an nn.Dropout (or Dropout2d, AlphaDropout...)
    with p > 0, whose masks differ between a whole batch, its micro-batches and its ranks' shards."""
    return any(
        isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training
        for module in model.modules()
    )


def keyed_dropout(x: Tensor, p: float, key_term: int) -> Tensor:
    """Dropout of `x` (rows first, or rows times tokens) in training: keyed by the loop's rows where it set them,
    else plain F.dropout. `key_term` is `mix_int` of the layer's key (KeyedDropout's; models/hf_keyed_dropout.py's
    for attention weights; the call's for functional dropout)."""
    keys = current_rows()
    if keys is None:  # outside the loop's rows
        return _torch_dropout(x, p, training=True)
    rows, step_key = keys
    if not len(rows):
        # A micro-batch of no rows, which a model may have run as a dummy row: its loss counts for nothing, and
        # torch's dropout would draw from the generator even for no elements (the CPU's bernoulli takes a seed first).
        return x
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
    return torch.where(keep.view(x.shape), x, 0.0).mul_(keep_scale(p))


# Each 64-bit hash decides _LANES neighbours along the last dimension, one 16-bit lane each: element t takes lane
# t % _LANES of hash t // _LANES (the lanes in memory order, the same on every little-endian device: x86, ARM,
# CUDA). A quarter of the hashing that one hash per element costs, and no uniforms in float: each lane is compared
# with an integer threshold.
_LANES = 4
_LANE_BITS = 64 // _LANES


def dropped_lanes(p: float) -> int:
    """Of the 2**16 values a lane takes, how many drop its element: p rounded to a multiple of 2**-16 (a p below
    2**-17 drops none; one above 1 - 2**-17 keeps 2**-16, not none)."""
    return min(round(p * 2**_LANE_BITS), 2**_LANE_BITS - 1)


def keep_scale(p: float) -> float:
    """What kept elements are multiplied by: one over the keep rate the masks have (not 1 / (1 - p), which p's
    rounding to 2**-16 would leave biased by up to 2**-17 / (1 - p) per layer)."""
    return 2**_LANE_BITS / (2**_LANE_BITS - dropped_lanes(p))


def keep_mask(shape: tuple[int, ...], p: float, rows: Tensor, layer_step_key: Tensor, first: int = 0) -> Tensor:
    """Whether each element of a tensor of `shape` (rows first, at least two dimensions) is kept: with probability
    1 - dropped_lanes(p) / 2**16. `first`: the tensor is a slice of a larger one along its second-to-last dimension
    (a block of attention's queries, hydraloop.keyed_attention), starting there; its elements are kept as the larger
    one's."""
    keys = element_keys(shape, rows, layer_step_key, first)  # lanes are picked by coordinate too: padding-free
    size = shape[-1]
    groups = torch.arange(-(-size // _LANES), dtype=torch.int64, device=rows.device) * GOLDEN
    lanes = mix_(keys[..., None] + groups).view(torch.int16)[..., :size]
    # A lane as an unsigned u in [0, 2**16) keeps its element where u >= dropped_lanes(p); as a signed one, where
    # it is at least that less 2**15.
    return lanes >= dropped_lanes(p) - 2 ** (_LANE_BITS - 1)


def key_functional_dropout(model: nn.Module) -> None:
    """`model`'s calls of `torch.nn.functional.dropout` (its own, and its modules') draw keyed masks: the n-th call in
    its forward pass is keyed as a layer of its own. torch's function is replaced by one that is torch's own outside
    such a forward pass (in any thread: DataParallel's replicas count in theirs), and outside the loop's rows."""
    if F.dropout is not _dropout_keyed_by_call:
        F.dropout = _dropout_keyed_by_call  # models look it up when they call it (nn.functional.dropout, F.dropout)
    model.register_forward_pre_hook(_count_calls)
    model.register_forward_hook(_stop_counting_calls, always_call=True)


def _count_calls(module: nn.Module, args: tuple) -> None:
    if current.depth == 0:  # a model that keys its calls, called inside another, counts on from the outer's
        current.calls = 0
    current.depth += 1


def _stop_counting_calls(module: nn.Module, args: tuple, outputs: object) -> None:
    current.depth -= 1
    if current.depth == 0:
        current.calls = None


def _dropout_keyed_by_call(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """torch.nn.functional.dropout, keyed in the forward pass of a model that asked for it, where the loop set the
    rows (or a checkpoint's recomputation of it); torch's own anywhere else."""
    calls = current.calls
    if calls is None or not current.active or not training or not 0.0 < p < 1.0:
        return _torch_dropout(input, p, training, inplace)
    current.calls = calls + 1
    dropped = keyed_dropout(input, p, mix_int(2 << 40 | calls))  # apart from KeyedDropout's and attention's keys
    return input.copy_(dropped) if inplace else dropped
