"""Random numbers drawn on a rank's shard of a tensor that are the whole tensor's draws, sliced.

Under FSDP a parameter and its gradient are DTensors of which each rank holds a shard. `torch.randn_like(param)` on
one draws the shard's numbers only: not the numbers one process draws for the whole parameter (on the CPU not even
different numbers on each shard, every rank's generator being in the same state). An optimizer or callback that draws
noise would then train other weights than single-process training does. Around the parts of a step that act on the
state the ranks hold (where hydraloop.seeding.StepSeeder.replicated has put every rank's generator in the same state),
FSDP enters `whole_tensor_draws`: each random operation on a DTensor is computed on the whole tensor, as one process
computes it, and each rank keeps its slice. That costs each rank the whole tensor's draws (what one process pays) and,
where the operation reads values (`torch.bernoulli(probabilities)`, dropout), a gather of them; those that only fill
(`randn_like`, `normal_`, `rand_like`, `uniform_`) gather nothing. Every other operation is DTensor's as usual: the
random ones are DTensor's custom handlers for that while (as torch's own `loss_parallel` installs its handlers).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only


def _overloads(*names: str) -> tuple:
    """Every overload of the ATen operators `names` but their out= variants."""
    packets = [getattr(torch.ops.aten, name) for name in names]
    return tuple(getattr(p, overload) for p in packets for overload in p.overloads() if not overload.endswith("out"))


# The random operations a parameter, a gradient or an optimizer's state meets. Those that fill their first argument
# in place or draw a tensor of its shape, whose values they do not read...
FILLING = _overloads(
    "normal_",
    "uniform_",
    "bernoulli_",
    "exponential_",
    "random_",
    "cauchy_",
    "log_normal_",
    "geometric_",
    "randn_like",
    "rand_like",
    "randint_like",
)
# ...and those whose draws depend on its values.
READING = _overloads("bernoulli", "normal", "native_dropout", "multinomial", "poisson")


@contextmanager
def whole_tensor_draws() -> Iterator[None]:
    """While active, a random operation with DTensor arguments draws what it draws on the whole tensors, and returns
    (or writes into a DTensor in place) this rank's part of that."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    added = [op for op in (*FILLING, *READING) if op not in handlers]
    handlers.update(dict.fromkeys(added, _drawn_whole))
    try:
        yield
    finally:
        for op in added:
            handlers.pop(op, None)


def _drawn_whole(op: Any, args: tuple, kwargs: dict) -> Any:
    first = next(leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, DTensor))
    in_place = op._schema.is_mutable  # the ones above write their first argument only
    if op in FILLING:
        # The first argument's values are not read (`normal_` overwrites them, `randn_like` takes the shape): it is
        # not gathered.
        head = args[0]
        template = torch.empty(head.shape, dtype=head.dtype, device=head.to_local().device)
        rest, whole_kwargs = tree_map_only(DTensor, DTensor.full_tensor, (args[1:], kwargs))
        whole = op(template, *rest, **whole_kwargs)
    else:
        whole_args, whole_kwargs = tree_map_only(DTensor, DTensor.full_tensor, (args, kwargs))
        whole = op(*whole_args, **whole_kwargs)
    if in_place:
        args[0].to_local().copy_(_part(whole, args[0]).to_local())
        return args[0]
    return tree_map(lambda out: _part(out, first) if isinstance(out, torch.Tensor) else out, whole)


def _part(whole: torch.Tensor, like: DTensor) -> DTensor:
    """`whole` as a DTensor laid out as `like` (each rank's slice of it; no communication), or replicated where it
    has another shape."""
    mesh = like.device_mesh
    if whole.shape == like.shape:
        placements = [p if isinstance(p, Shard) else Replicate() for p in like.placements]  # a Partial is summed
    else:
        placements = [Replicate()] * mesh.ndim
    return distribute_tensor(whole, mesh, placements, src_data_rank=None)
