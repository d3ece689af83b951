import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop.errors import require
from hydraloop.tasks.base import Task, count, logits, misfit, task_name

IGNORED = -100
"""A target that is no token (padding, or the last position of a sequence): PyTorch's and Hugging Face's convention."""


class LanguageModel(Task):
    """Next-token prediction: logits (B, T, vocab) against the next tokens (B, T). Cross-entropy per token;
    val/loss (nats per token), val/ppl (its exponential, the perplexity) and val/acc (next-token accuracy).

    `padded` (data=hf_lm's sequences of their own lengths, padded per batch): targets of IGNORED count for nothing,
    and the training loss is the mean over the global batch's target tokens, not a mean of its rows' means: each
    micro-batch is weighted by its tokens (`loss_weight`), so ddp, fsdp and accumulation train what one process does.
    """

    metrics = {"val/loss": "min", "val/ppl": "min", "val/acc": "max"}
    default_metric = "val/loss"

    def __init__(self, vocab_size: int, block_size: int, padded: bool = False) -> None:
        self.vocab_size = vocab_size
        self.padded = padded
        self.tokens_per_sample = None if padded else block_size  # padded: block_size only bounds a sample's tokens
        self.num_statistics = 3  # loss sum, correct, tokens

    def loss(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        if not self.padded:
            return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
        # A mean over the micro-batch's tokens, 0 where it has none (a mean over none would be NaN, and NaN times the
        # loop's weight of 0 still NaN).
        loss_sum = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction="sum")
        return loss_sum / self.loss_weight_of(targets).clamp(min=1)

    def loss_weight(self, batch: Any) -> Tensor | None:
        return self.loss_weight_of(self.split(batch)[1]) if self.padded else None

    @staticmethod
    def loss_weight_of(targets: Tensor) -> Tensor:
        return (targets != IGNORED).sum()

    def statistics(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        flat, targets = outputs.float().flatten(0, 1), targets.flatten()
        loss_sum = F.cross_entropy(flat, targets, ignore_index=IGNORED, reduction="sum").double()
        correct = (flat.argmax(dim=1) == targets).sum().double()
        tokens = self.loss_weight_of(targets).double() if self.padded else count(outputs, targets.numel())
        return torch.stack([loss_sum, correct, tokens])

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        loss_sum, correct, tokens = totals
        loss = loss_sum / tokens
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 700.0)), "val/acc": correct / tokens}

    def predictions(self, outputs: Any) -> dict[str, Tensor]:
        outputs = logits(outputs, self)
        return {"next_token": outputs.argmax(dim=2)}  # the most likely next token after each position

    def check(self, cfg: Any) -> None:
        data_vocab, data_block = cfg.data.get("vocab_size"), cfg.data.get("block_size")
        require(
            data_vocab is not None and data_block is not None,
            f"{task_name(cfg)}: needs token sequences (data.vocab_size and data.block_size, as data=text has)",
        )
        model_vocab, model_block = cfg.model.get("vocab_size"), cfg.model.get("block_size")
        require(
            model_vocab is None or model_vocab >= data_vocab,
            f"model.vocab_size={model_vocab}: smaller than the data's vocabulary, data.vocab_size={data_vocab}",
        )
        require(
            model_block is None or model_block >= data_block,
            f"data.block_size={data_block}: longer than the model's context, model.block_size={model_block}",
        )

    def check_targets(self, targets: Tensor, where: str) -> None:
        if targets.is_floating_point() or targets.dim() != 1:
            kind = "real-valued" if targets.is_floating_point() else "integer"
            raise misfit(self, where, f"{kind} targets of shape {list(targets.shape)}", "one token per position")
