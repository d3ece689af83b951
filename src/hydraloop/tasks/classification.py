from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop.errors import ConfigError, require
from hydraloop.tasks.base import Task, count, logits, misfit, task_name


class Classification(Task):
    """Class logits (N, C) against integer labels (N,): cross-entropy, accuracy, and top-5 accuracy when there are
    more than 5 classes (the ImageNet recipe's Acc@1 and Acc@5).

    `label_smoothing` changes the training loss only; val/loss stays the plain cross-entropy, comparable across runs.
    """

    metrics = {"val/loss": "min", "val/acc": "max", "val/acc_top5": "max"}
    default_metric = "val/acc"

    def __init__(self, num_classes: int, label_smoothing: float = 0.0) -> None:
        require(0.0 <= label_smoothing < 1.0, f"task.label_smoothing={label_smoothing}: must be at least 0 and below 1")
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.top5 = num_classes > 5
        self.num_statistics = 4 if self.top5 else 3  # loss sum, correct, (correct in the top 5,) count

    def reported_metrics(self) -> list[str]:
        return [name for name in self.metrics if self.top5 or name != "val/acc_top5"]

    def loss(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        # More scores than classes would train silently (fewer fail on the device); checked on the launcher's trial
        # batch too, so a model built for another number of classes is one line before any rank starts.
        if outputs.dim() == 2 and outputs.shape[1] != self.num_classes:  # no message built on the hot path
            raise ConfigError(
                f"the model gives {outputs.shape[1]} scores per sample, for data.num_classes={self.num_classes} "
                "classes (a classifier's head: model.num_labels, model.num_classes or its config's, where set by hand)"
            )
        return F.cross_entropy(outputs, targets, label_smoothing=self.label_smoothing)

    def statistics(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        outputs = outputs.float()
        sums = [
            F.cross_entropy(outputs, targets, reduction="sum").double(),
            (outputs.argmax(dim=1) == targets).sum().double(),
        ]
        if self.top5:
            sums.append((outputs.topk(5, dim=1).indices == targets[:, None]).any(dim=1).sum().double())
        return torch.stack([*sums, count(outputs, len(targets))])

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        *sums, n = totals
        return dict(zip(self.reported_metrics(), [sums[0] / n, *(correct / n for correct in sums[1:])]))

    def predictions(self, outputs: Any) -> dict[str, Tensor]:
        outputs = logits(outputs, self)
        return {"class": outputs.argmax(dim=1), "probabilities": outputs.float().softmax(dim=1)}

    def check(self, cfg: Any) -> None:
        require(
            cfg.data.get("target_shape") is None,
            f"{task_name(cfg)}: needs integer class labels, but data.target_shape={cfg.data.target_shape} says the "
            "targets are real values (task=regression fits them)",
        )
        require(
            cfg.data.get("vocab_size") is None,
            f"{task_name(cfg)}: the data are token sequences (data.vocab_size={cfg.data.get('vocab_size')}); "
            "task=language_model fits them",
        )
        require(cfg.data.num_classes >= 2, f"data.num_classes={cfg.data.num_classes}: classification needs at least 2")

    def check_all_targets(self, targets: Tensor, where: str) -> None:
        if targets.is_floating_point() or not targets.numel():  # check_targets names real-valued ones
            return
        low, high = int(targets.min()), int(targets.max())
        require(
            low >= 0 and high < self.num_classes,
            f"data.num_classes={self.num_classes}: the training set's labels run from {low} to {high}, outside "
            f"[0, {self.num_classes}) ({where})",
        )

    def check_targets(self, targets: Tensor, where: str) -> None:
        if targets.is_floating_point() or targets.dim() != 0:
            kind = "real-valued" if targets.is_floating_point() else "integer"
            shape = f" of shape {list(targets.shape)}" if targets.dim() else ""
            raise misfit(self, where, f"{kind} targets{shape}", "one integer class label per sample")
