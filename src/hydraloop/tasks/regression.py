import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop.errors import require
from hydraloop.tasks.base import Task, count, logits, misfit, task_name


class Regression(Task):
    """Real-valued targets shaped `target_shape` per sample; the model's outputs (N, prod(target_shape)) are read in
    that shape. Mean squared error; val/mse, val/mae and val/r2.

    R² is each target value's 1 - SSE / SST, averaged over the values (scikit-learn's r2_score, uniform average). SST
    comes from the sums of y and y², so all three metrics are sums reduced once: exact under every strategy.
    """

    metrics = {"val/mse": "min", "val/mae": "min", "val/r2": "max"}
    default_metric = "val/mse"

    def __init__(self, target_shape: list[int] | None) -> None:
        """`target_shape` null (class labels) is refused by `check`, in the launcher."""
        self.target_shape = list(target_shape or [])
        self.width = math.prod(self.target_shape)
        self.num_statistics = 3 * self.width + 2  # per value: squared errors, y, y²; then absolute errors, count

    def loss(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        return F.mse_loss(outputs.reshape(targets.shape), targets)

    def metric_inputs(self, outputs: Any, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The outputs in the targets' shape, as the loss reads them: (N,) for one value, where the model gives
        (N, 1), and torchmetrics' regression metrics want the two alike."""
        return logits(outputs, self).reshape(targets.shape), targets

    def statistics(self, outputs: Any, targets: Tensor) -> Tensor:
        outputs = logits(outputs, self)
        y = targets.double().reshape(len(targets), self.width)
        error = outputs.double().reshape(y.shape) - y
        per_value = [(error**2).sum(dim=0), y.sum(dim=0), (y**2).sum(dim=0)]  # each (width,)
        return torch.cat([*per_value, error.abs().sum().reshape(1), count(outputs, len(y)).reshape(1)])

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        w = self.width
        sse, sum_y, sum_y2 = totals[:w], totals[w : 2 * w], totals[2 * w : 3 * w]
        abs_error, n = totals[3 * w :]
        r2 = [_r2(e, s, s2, n) for e, s, s2 in zip(sse, sum_y, sum_y2)]
        return {"val/mse": sum(sse) / (n * w), "val/mae": abs_error / (n * w), "val/r2": sum(r2) / w}

    def predictions(self, outputs: Any) -> dict[str, Tensor]:
        outputs = logits(outputs, self)
        return {"prediction": outputs.float().reshape(len(outputs), *self.target_shape)}

    def check(self, cfg: Any) -> None:
        target_shape = cfg.data.get("target_shape")
        require(
            target_shape is not None,
            f"{task_name(cfg)}: needs real-valued targets, but data.target_shape=null says the data has class labels "
            "(task=classification fits them; data=tensors takes real targets with data.target_shape=[...])",
        )
        width = math.prod(target_shape)
        require(
            cfg.data.num_classes == width,
            f"data.num_classes={cfg.data.num_classes}: the model's output width, must be {width} for "
            f"data.target_shape={list(target_shape)} under {task_name(cfg)}",
        )

    def check_targets(self, targets: Tensor, where: str) -> None:
        if not targets.is_floating_point() or list(targets.shape) != self.target_shape:
            kind = "real-valued" if targets.is_floating_point() else "integer"
            raise misfit(
                self, where, f"{kind} targets of shape {list(targets.shape)}", f"real values shaped {self.target_shape}"
            )


def _r2(sse: float, sum_y: float, sum_y2: float, n: float) -> float:
    sst = sum_y2 - sum_y**2 / n
    if sst <= 0:  # constant targets: as scikit-learn, 1 for a perfect fit, else 0
        return 1.0 if sse == 0 else 0.0
    return 1 - sse / sst
