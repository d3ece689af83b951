"""A small decoder-only transformer (GPT), after nanoGPT: `model=gpt`, with `data=text`.

Token and learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a 4x GELU MLP), a final LayerNorm, and an output head that shares its weight
with the token embedding. Initialised as GPT-2 is. `forward` maps token ids (B, T) to next-token logits (B, T, vocab).

Dropout is KeyedDropout (hydraloop.keyed_dropout), on the embeddings and on each residual branch, so that training
with dropout ends with the same weights under every strategy. The attention weights are not dropped: the fused
attention kernels draw that mask from the device's generator, which would tie the result to how the batch is split.
"""

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hydraloop.errors import ConfigError
from hydraloop.keyed_dropout import KeyedDropout


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, dropout_key: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # queries, keys and values of all heads in one matmul
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = KeyedDropout(dropout, key=dropout_key)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = (
            t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(channels, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the fused kernel masks the future itself
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool, dropout_key: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.out_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = KeyedDropout(dropout, key=dropout_key)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.out_proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x)). Under `parallel=fsdp` each
    block is one shard unit (GPT._no_split_modules)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, dropout_key=1 + 2 * index)
        self.mlp_norm = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias, dropout_key=2 + 2 * index)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    # Hugging Face's name for the modules that must stay whole: here also the FSDP units.
    _no_split_modules = ["Block"]

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        for key, value in (("vocab_size", vocab_size), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key}={value}: must be a positive integer (data=text sets data.{key})")
        for key, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if value < 1:
                raise ConfigError(f"model.{key}={value}: must be positive")
        if n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd}: must be divisible by model.n_head={n_head}")
        if not 0 <= dropout < 1:
            raise ConfigError(f"model.dropout={dropout}: must be in [0, 1)")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.dropout = KeyedDropout(dropout, key=0)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias, index) for index in range(n_layer))
        self.final_norm = nn.LayerNorm(n_embd, bias=bias)
        # The output head is the token embedding's weight (tying, Press & Wolf 2017, as GPT-2), applied in forward
        # rather than held by an nn.Linear of its own: FSDP cannot put one parameter in two units, and
        # parallel=fsdp's default units are the Linear modules.
        self.apply(_init_gpt2)
        # GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 * n_layer): two per block,
        # so the stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith("out_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T), T <= block_size -> next-token logits (B, T, vocab_size)."""
        time = idx.shape[1]
        if time > self.block_size:
            raise ValueError(f"GPT: a sequence of {time} tokens is longer than model.block_size={self.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.final_norm(x), self.token_embedding.weight)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the token embedding, which is also the output head, once). non_embedding: without the position
        embedding (the token embedding stays: as the output head it does matmul work), as nanoGPT counts them."""
        count = sum(parameter.numel() for parameter in self.parameters())
        return count - self.position_embedding.weight.numel() if non_embedding else count

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward and backward) per token at sequence length `seq_len`: 6 per parameter (2 forward,
        4 backward) plus attention's scores and weighted sum, 12 * n_layer * n_embd * seq_len. nanoGPT's
        estimate_mfu and torchtitan count the same (PaLM paper, appendix B)."""
        return 6.0 * self.num_params() + 12.0 * self.n_layer * self.n_embd * seq_len

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        vocab_size: int | None = None,
    ) -> Tensor:
        """Appends `max_new_tokens` tokens to each row of `idx` (B, T), each from the last block_size tokens.

        temperature 0 takes the most likely token (greedy); otherwise logits / temperature are sampled from, with
        `generator` (on idx's device) so that the same seed gives the same tokens. top_k keeps only the k most
        likely tokens. `vocab_size` (the tokenizer's) draws from its ids alone, where the embeddings are padded past
        them (nanoGPT's GPT-2: 50304 for 50257). Runs in eval mode (no dropout) and restores the module's mode
        afterwards.
        """
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: must be >= 0 (0: greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: must be a positive integer, or None for no limit")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.block_size :])[:, -1, :vocab_size].float()
                if temperature == 0:
                    next_token = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth_largest = torch.topk(logits, top_k).values[:, -1:]
                        logits = logits.masked_fill(logits < kth_largest, -math.inf)
                    next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
                idx = torch.cat((idx, next_token), dim=1)
        finally:
            self.train(was_training)
        return idx


def _init_gpt2(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
