"""hydraloop.keyed_attention: attention with keyed dropout, a block of queries at a time, computes what the explicit
attention computes (keyed_dropout on the whole weights), and keeps none of the (batch, heads, T, T) weights."""

import pytest
import torch

from hydraloop.keyed_attention import BLOCK, blocked_keyed_attention
from hydraloop.keyed_dropout import RowKeys, current_rows, keyed_dropout, mix_int

CPU = torch.device("cpu")


def test_blocks_of_queries_give_the_explicit_attention_and_its_gradients():
    """Blocks of 16 over 70 queries (the last one short), a causal mask with padded keys and a query that sees no key
    (the mask's minimum on every score, as transformers' eager mask gives): values and gradients in float64."""
    batch, heads, length, dim, p = 3, 2, 70, 8, 0.3
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(length, length).tril().bool().expand(batch, 1, length, length).clone()
    allowed[1, :, :, 60:] = False  # the second sample's last 10 tokens are padding
    allowed[2, :, 5] = False  # a query that sees nothing
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill_(~allowed, torch.finfo(torch.float64).min)
    key_term = mix_int(12345)

    def attention(blocked: bool):
        inputs = [tensor.clone().requires_grad_() for tensor in (q, k, v)]
        with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(step=4, first_row=0, rows=batch):
            if blocked:
                out = blocked_keyed_attention(*inputs, mask, p, dim**-0.5, *current_rows(), key_term, block=16)
            else:
                weights = torch.softmax(inputs[0] @ inputs[1].transpose(-1, -2) * dim**-0.5 + mask, dim=-1)
                out = keyed_dropout(weights, p, key_term) @ inputs[2]
        out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float64)).view(out.shape))
        return out.detach(), [tensor.grad for tensor in inputs]

    explicit, explicit_grads = attention(blocked=False)
    blocked, blocked_grads = attention(blocked=True)
    torch.testing.assert_close(blocked, explicit, rtol=1e-12, atol=1e-12)
    for got, expected in zip(blocked_grads, explicit_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_a_long_sequence_keeps_no_attention_weights_for_the_backward_pass():
    """A GPT-2 with attention dropout: past 2 x BLOCK tokens nothing of (batch, heads, T, T) is saved for the
    backward pass; at 2 x BLOCK, the explicit attention's weights are. The largest saved is then transformers' own
    additive mask, (batch, 1, T, T), which it builds for every layer's attention whatever computes it."""
    pytest.importorskip("transformers", reason="the hf extra (in dev)")
    from hydraloop.models.hf import hf_model

    heads, batch = 4, 2
    config = {"n_layer": 1, "n_embd": 16, "n_head": heads, "n_positions": 2 * BLOCK + 8, "attn_pdrop": 0.2}
    model = hf_model(model_type="gpt2", config=config, vocab_size=50).train()

    def largest_saved(length: int) -> int:
        ids = torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(1))
        sizes = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t)
        with hooks, RowKeys(seed=0, rank=0, world_size=1, device=CPU)(step=1, first_row=0, rows=batch):
            loss = model(ids, labels=ids).loss
        loss.backward()  # as the loop's: outside its rows
        return max(sizes)

    assert largest_saved(2 * BLOCK) == batch * heads * (2 * BLOCK) ** 2  # explicit: the weights are saved
    long = 2 * BLOCK + 8
    assert largest_saved(long) == batch * long**2  # blocked: the mask, no weights
