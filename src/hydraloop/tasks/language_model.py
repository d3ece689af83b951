import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop.errors import require
from hydraloop.tasks.base import Task, count, logits, misfit, task_name


class LanguageModel(Task):
    """Next-token prediction: logits (B, T, vocab) against the next tokens (B, T). Cross-entropy per token;
    val/loss (nats per token), val/ppl (its exponential, the perplexity) and val/acc (next-token accuracy)."""

    metrics = {"val/loss": "min", "val/ppl": "min", "val/acc": "max"}
    default_metric = "val/loss"

    def __init__(self, vocab_size: int, block_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokens_per_sample = block_size
        self.num_statistics = 3  # loss sum, correct, tokens

    def loss(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def statistics(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        flat, targets = outputs.float().flatten(0, 1), targets.flatten()
        loss_sum = F.cross_entropy(flat, targets, reduction="sum").double()
        correct = (flat.argmax(dim=1) == targets).sum().double()
        return torch.stack([loss_sum, correct, count(outputs, targets.numel())])

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
