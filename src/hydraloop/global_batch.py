"""The loop's side of a loss over the global batch (hydraloop.tasks.global_batch): the gather of every rank's rows,
a step's passes, and validation's statistics.

Rank r holds rows r, r+N, r+2N, ... of a global batch of G rows (the samplers deal them so), so padded to
ceil(G / N) rows each and stacked rank after rank along a second dimension, the ranks' rows read in the global
batch's order: row j of rank r is global row r + N * j. The padding falls past row G, and is cut off. The gathered
rows of other ranks carry no gradient; this rank's own rows keep theirs, so the backward pass of the global loss
reaches this rank's parameters through its own rows only. Every rank computes the same global loss L, and DDP and
FSDP average the ranks' gradients: each rank's backward of N * L sums, over the ranks, to the gradient one process
computes of L (open_clip's `gather_features` without `gather_with_grad` works so).

Gradient accumulation (GradCache, Gao et al. 2021, as open_clip's `accum_freq`): the rows of every micro-batch are
computed first without gradients and gathered; the global loss and its gradient with respect to the gathered rows
follow; then each micro-batch is computed again, with gradients, and its backward pass is of its rows times their
share of that gradient. Its parameters' gradient is then the global loss's, to round-off. The first pass's changes to
buffers (batch norm's running statistics) are undone: one step moves them once, as in one process.
"""

import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from hydraloop.batches import count_rows, map_tensors, tensors


def gather_rows(local: Any, global_rows: int, strategy: Any) -> Any:
    """The global batch's rows of every tensor in `local` (this rank's rows, its structure), in the global batch's
    order; this rank's own keep their gradient."""
    world_size = strategy.world_size
    if world_size == 1:
        return local
    most = math.ceil(global_rows / world_size)

    def gathered(tensor: Tensor) -> Tensor:
        padded = torch.cat([tensor, tensor.new_zeros(most - len(tensor), *tensor.shape[1:])])
        parts = strategy.all_gather(padded.detach().contiguous())
        parts[strategy.rank] = padded
        return torch.stack(parts, dim=1).flatten(0, 1)[:global_rows]

    return map_tensors(gathered, local)


def global_batch_backward(step: Any, micro_batches: list, global_rows: int, keys: Any) -> Tensor:
    """The backward passes of an optimizer step (hydraloop.step.OptimizerStep `step`) over this rank's micro-batches
    for a task with a loss over the global batch; returns this rank's share of the step's loss (the global loss,
    which every rank computes: the shares add up to it times the world size, as a mean loss's do). `keys(first_row,
    rows)`: the rows' context for keyed draws."""
    task, model, precision, strategy = step.task, step.model, step.precision, step.strategy
    if len(micro_batches) == 1:
        ((micro_batch, first_row, rows),) = micro_batches
        with precision.autocast(), keys(first_row, rows):
            loss = task.batch_loss(gather_rows(task.embed(model, micro_batch), global_rows, strategy))
        precision.backward(loss * strategy.world_size)
        return loss.detach()
    buffers = [buffer.clone() for buffer in step.float_buffers]
    with torch.no_grad():
        parts = []
        for micro_batch, first_row, rows in micro_batches:
            with precision.autocast(), keys(first_row, rows):
                parts.append(task.embed(model, micro_batch))
        for buffer, saved in zip(step.float_buffers, buffers):
            buffer.copy_(saved)
    cached = map_tensors(_leaf, gather_rows(_joined(parts), global_rows, strategy))
    leaves = [tensor for _, tensor in tensors(cached) if tensor.requires_grad]
    with torch.enable_grad():
        loss = task.batch_loss(cached)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    # This rank's rows of the gradient, in its local order (global row r + N * j is its j-th).
    own = [
        torch.zeros_like(leaf[strategy.rank :: strategy.world_size])
        if grad is None
        else grad[strategy.rank :: strategy.world_size]
        for leaf, grad in zip(leaves, grads)
    ]
    last = len(micro_batches) - 1
    for i, (micro_batch, first_row, rows) in enumerate(micro_batches):
        with strategy.no_sync(model) if i < last else nullcontext():
            with precision.autocast(), keys(first_row, rows):
                outputs = [t for _, t in tensors(task.embed(model, micro_batch)) if t.is_floating_point()]
            surrogate = sum(
                (output.float() * grad[first_row : first_row + len(output)]).sum() for output, grad in zip(outputs, own)
            )
            precision.backward(surrogate * strategy.world_size)
    return loss.detach()


def global_batch_statistics(task: Any, module: Any, batch: Any, strategy: Any) -> Tensor:
    """A validation batch's statistics for a task with a loss over the global batch: this rank's rows' share of
    the statistics of the global validation batch (each rank's shard of the validation set holds rows r, r+N, ...
    of it, as in training)."""
    rows = torch.full((1,), count_rows(batch), device=strategy.device)
    global_rows = int(strategy.all_reduce(rows).item())
    statistics = task.batch_statistics(gather_rows(task.embed(module, batch), global_rows, strategy))
    return statistics[strategy.rank :: strategy.world_size].sum(dim=0)


def _joined(parts: list) -> Any:
    """Micro-batches' outputs of one structure, joined along their rows."""
    flat = [[tensor for _, tensor in tensors(part)] for part in parts]
    joined = iter([torch.cat(column) for column in zip(*flat)])
    return map_tensors(lambda _: next(joined), parts[0])


def _leaf(tensor: Tensor) -> Tensor:
    """A gathered tensor as a leaf the global loss's gradient is taken with respect to (in float32: the gradient of
    a float16 loss could underflow); integer tensors (labels) as they are."""
    return tensor.float().requires_grad_() if tensor.is_floating_point() else tensor
