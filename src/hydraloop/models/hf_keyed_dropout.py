"""Keyed dropout in a transformers model: the same masks under single-process training, ddp and accumulation.

A transformers model draws its dropout masks with torch's generator (nn.Dropout, and functional dropout on the
attention weights), so single-process training, ddp and accumulation would each compute different weights.
model=hf's `keyed_dropout=true` (the default) replaces every nn.Dropout with hydraloop's KeyedDropout and computes
attention through `hydraloop_keyed`, an attention function whose dropout is keyed the same way
(hydraloop.keyed_dropout): every strategy then trains the same weights. It computes attention with torch's
scaled_dot_product_attention when no dropout applies (evaluation, or no attention dropout), and otherwise explicitly
(softmax, then the keyed mask): on a GPU, and for sequences past 2 x hydraloop.keyed_attention.BLOCK, a block of
queries at a time, so that the (batch, heads, T, T) weights are never all held. A model that calls dropout as a
function (OPT, BART, Whisper) has those calls keyed by their order in its forward pass
(keyed_dropout.key_functional_dropout).
"""

from typing import Any

import torch
from torch import Tensor, nn

from hydraloop.keyed_attention import BLOCK, blocked_keyed_attention
from hydraloop.keyed_dropout import KeyedDropout, key_functional_dropout, keyed_dropout
from hydraloop.row_keys import current_rows, mix_int

KEYED_ATTENTION = "hydraloop_keyed"


def use_keyed_dropout(model: nn.Module) -> None:
    """Every nn.Dropout becomes a KeyedDropout of the same p, keyed by its place in the model; every module gets
    the key its attention weights' dropout draws with (`keyed_attention`); calls of nn.functional.dropout are keyed
    by their order in the forward pass."""
    key_functional_dropout(model)
    replaced = 0
    for index, module in enumerate(list(model.modules())):
        module.keyed_dropout_key = mix_int(1 << 40 | index)  # apart from the KeyedDropouts' keys below
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                replaced += 1
                setattr(module, name, KeyedDropout(child.p, key=replaced))


def keyed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: (batch, heads, time, head_dim) in, (batch, time, heads, head_dim) out.
    `attention_mask` is additive (the eager mask registered beside it), covering causality and padding."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves several query heads
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if dropout == 0.0 or not module.training:
        causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", False)
        output = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal
        )
        return output.transpose(1, 2).contiguous(), None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    keys = current_rows()
    # hydraloop.keyed_attention: on a GPU, where torch's attention with dropout would be fused and store no weights,
    # and for long sequences anywhere (on the CPU torch has no fused kernel with dropout: the explicit attention is
    # what transformers' own model computes there, and cheaper for short ones). It takes a batch of the loop's rows
    # (not one flattened into several rows a sample) and a mask that is not trained (it gives the mask no gradient).
    long_or_fused = query.shape[2] > 2 * BLOCK or query.device.type == "cuda"
    blocked = keys is not None and len(keys[0]) == query.shape[0] and long_or_fused
    if blocked and (attention_mask is None or not attention_mask.requires_grad):
        output = blocked_keyed_attention(
            query, key, value, attention_mask, dropout, scaling, *keys, module.keyed_dropout_key
        )
        return output.transpose(1, 2).contiguous(), None
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = keyed_dropout(weights, dropout, module.keyed_dropout_key)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def register_keyed_attention() -> None:
    """`attn_implementation="hydraloop_keyed"`: keyed_attention, with transformers' eager (additive) masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(KEYED_ATTENTION, keyed_attention)
    AttentionMaskInterface.register(KEYED_ATTENTION, eager_mask)
