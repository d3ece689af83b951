"""Attention with keyed dropout on its weights that never holds all of them: a block of queries at a time.

Dropout on attention's weights needs the weights: torch's fused kernels draw their masks inside the kernel, from
torch's generator, which is not keyed by sample (hydraloop.keyed_dropout), and there is no fused kernel to hand
keyed masks to. Computed explicitly, the (batch, heads, T, T) weights and their mask are kept for the backward pass:
memory grows with the square of the sequence, as flash attention's never does. `blocked_keyed_attention` computes
the same thing a block of queries at a time, as flash attention does: the forward pass keeps only the output and
each query's largest score and sum of exponentials, and the backward pass recomputes each block's weights, and its
mask from the keys, which are a function of (seed, step, layer, sample, head, query, key) and so come out the same.
The largest tensor at any time is a block's weights, (batch, heads, block, T). It costs a second product of queries
and keys, and a second hash of the mask, in the backward pass (on a CPU, at 1024 tokens, less than the explicit
attention's traffic through the whole weights saves: docs/benchmarks.md); models/hf_keyed_dropout.py uses it on
GPUs, and on the CPU for sequences longer than 2 x BLOCK.
"""

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from hydraloop.keyed_dropout import keep_mask, keep_scale
from hydraloop.row_keys import layer_key

BLOCK = 128  # queries per block


def blocked_keyed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    additive_mask: Tensor | None,
    p: float,
    scale: float,
    rows: Tensor,
    step_key: Tensor,
    key_term: int,
    block: int = BLOCK,
) -> Tensor:
    """softmax(query @ key^T * scale + additive_mask), its elements dropped by keyed masks with probability `p`,
    times value: (batch, heads, T_query, head_dim), as `keyed_dropout(softmax(...), p, key_term) @ value` computes
    it, to round-off. `additive_mask` broadcasts to (batch, heads, T_query, T_key) and gets no gradient; `rows` and
    `step_key` are the loop's (hydraloop.row_keys.current_rows), a row per sample of the batch."""
    # Copies: the loop refills its row tensors for the next micro-batch before this one's backward pass.
    return _BlockedKeyedAttention.apply(
        query, key, value, additive_mask, p, scale, rows.clone(), layer_key(step_key, key_term), block
    )


def _block_scores(
    query: Tensor, key: Tensor, additive_mask: Tensor | None, scale: float, start: int, end: int
) -> Tensor:
    """The scores of queries start:end before the softmax, rounded as the explicit attention rounds them (in the
    inputs' and the mask's dtypes: a float16 mask's minimum then swamps the score), then in float32 at least."""
    scores = torch.matmul(query[:, :, start:end], key.transpose(-1, -2)) * scale
    if additive_mask is not None:
        scores = scores + (additive_mask[:, :, start:end] if additive_mask.shape[2] > 1 else additive_mask)
    return scores.to(_accumulated(query))


def _accumulated(tensor: Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


class _BlockedKeyedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, additive_mask, p, scale, rows, layer_step_key, block):
        batch, heads, queries, _ = query.shape
        output = torch.empty_like(query)
        # Each query's largest score and sum of exponentials: the softmax, recomputed in the backward pass. Kept
        # apart, not as one log-sum-exp: a query that may see no key has every score at the mask's minimum, where
        # adding log(T) to it would round away, and the weights would come back as 1 instead of 1 / T.
        largest = query.new_empty((batch, heads, queries, 1), dtype=_accumulated(query))
        total = torch.empty_like(largest)
        for start in range(0, queries, block):
            end = min(start + block, queries)
            scores = _block_scores(query, key, additive_mask, scale, start, end)
            largest[:, :, start:end] = scores.amax(dim=-1, keepdim=True)
            weights = scores.sub_(largest[:, :, start:end]).exp_()
            total[:, :, start:end] = weights.sum(dim=-1, keepdim=True)
            weights /= total[:, :, start:end]
            kept = keep_mask(weights.shape, p, rows, layer_step_key, first=start)
            weights = torch.where(kept, weights, 0.0).mul_(keep_scale(p)).to(value.dtype)
            output[:, :, start:end] = torch.matmul(weights, value)
        ctx.save_for_backward(query, key, value, additive_mask, output, largest, total, rows, layer_step_key)
        ctx.p, ctx.scale, ctx.block = p, scale, block
        return output

    @staticmethod
    @once_differentiable  # its backward is not itself differentiable: a second derivative is refused, not wrong
    def backward(ctx, grad_output):
        query, key, value, additive_mask, output, largest, total, rows, layer_step_key = ctx.saved_tensors
        p, scale, block = ctx.p, ctx.scale, ctx.block
        grad_query = torch.empty_like(query)
        accumulated = _accumulated(query)
        grad_key = torch.zeros_like(key, dtype=accumulated)
        grad_value = torch.zeros_like(value, dtype=accumulated)
        # Each query's sum over keys of dL/d(weight) x weight: as the output's, sum of grad_output x output.
        delta = (grad_output.to(accumulated) * output.to(accumulated)).sum(dim=-1, keepdim=True)
        for start in range(0, query.shape[2], block):
            end = min(start + block, query.shape[2])
            weights = _block_scores(query, key, additive_mask, scale, start, end)
            weights = weights.sub_(largest[:, :, start:end]).exp_().div_(total[:, :, start:end])
            kept = keep_mask(weights.shape, p, rows, layer_step_key, first=start)
            dropped = torch.where(kept, weights, 0.0).mul_(keep_scale(p))
            block_grad = grad_output[:, :, start:end]
            grad_value += torch.matmul(dropped.transpose(-1, -2).to(value.dtype), block_grad).to(accumulated)
            grad_dropped = torch.matmul(block_grad, value.transpose(-1, -2)).to(accumulated)
            grad_weights = torch.where(kept, grad_dropped, 0.0).mul_(keep_scale(p))
            grad_scores = weights.mul_(grad_weights.sub_(delta[:, :, start:end])).mul_(scale).to(query.dtype)
            grad_query[:, :, start:end] = torch.matmul(grad_scores, key)
            grad_key += torch.matmul(grad_scores.transpose(-1, -2), query[:, :, start:end]).to(accumulated)
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None, None, None, None
