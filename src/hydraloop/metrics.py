"""More validation metrics, by name, from torchmetrics (the `metrics` extra): the top-level `metrics` node.

    python src/train.py +metrics.f1='{_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10,
        average: macro}' +metrics.auroc='{_target_: torchmetrics.classification.MulticlassAUROC, num_classes: 10}'

reports val/f1 and val/auroc beside the task's own metrics, from every validation. Each is any torchmetrics.Metric
(a class of one's own too), updated with what the task's `metric_inputs` gives (the logits and the targets, for the
shipped tasks) on each rank's validation shard, which holds each sample once, unpadded; `compute` then gathers the
ranks' states over the run's process group, so the values under ddp and fsdp are single-process training's.
Which direction is better comes from the class's `higher_is_better` (optimized_metric=val/f1 just works). The
launcher updates and computes each one on stand-ins for the task's outputs before any rank starts (hydraloop.trial):
one that cannot take them (BinaryF1Score on 10-class logits), or computes more than one number, is one line.
"""

import difflib
import importlib.util
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from hydraloop.errors import ConfigError, first_line, unwrap_instantiation


class MetricSet:
    """The `metrics` node's metrics, by their reported names (val/NAME), on one device."""

    def __init__(self, node: Any, device: torch.device) -> None:
        self.metrics = {f"val/{name}": metric.to(device) for name, metric in build_metrics(node).items()}

    def __bool__(self) -> bool:  # none configured: validation does nothing for them
        return bool(self.metrics)

    @property
    def names(self) -> list[str]:
        return list(self.metrics)

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        for metric in self.metrics.values():
            metric.update(predictions.float(), targets)

    def check(self, predictions: torch.Tensor, targets: torch.Tensor, source: str) -> None:
        """Each metric updated with `predictions` and `targets` (stand-ins for a validation batch's, on the CPU) and
        computed to one number, as validation does, then reset: the launcher's trial (hydraloop.trial). What cannot
        is one line naming the metric's key, what it was given (`source` says whose), and what it said."""
        given = f"predictions {_shown(predictions)} and targets {_shown(targets)}"
        for name, metric in self.metrics.items():
            # A class's declared sizes, what a mismatch is usually about (torchmetrics' messages give no number).
            sizes = [f"{size}={getattr(metric, size)}" for size in SIZES if getattr(metric, size, None) is not None]
            key = f"metrics.{name.removeprefix('val/')} ({', '.join([type(metric).__name__, *sizes])})"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # no positive samples, say: the stand-ins' values, not the data's
                    metric.update(predictions.float(), targets)
                    value = metric.compute()
            except Exception as error:  # noqa: BLE001  the metric's refusal of what it was given, as one line
                raise ConfigError(f"{key} cannot take {source}, {given}: {first_line(error)}") from None
            finally:
                metric.reset()
            if not (isinstance(value, torch.Tensor) and value.numel() == 1):
                kind = type(value).__name__
                shape = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else f"a {kind}"
                raise ConfigError(
                    f"{key}: computes {shape} from {given}, where validation logs one number per metric "
                    "(a per-class metric averages with average: macro, say)"
                )

    def compute(self) -> dict[str, float]:
        """Every metric over the whole validation set (a collective: every rank calls it), then reset."""
        values = {}
        for name, metric in self.metrics.items():
            values[name] = float(metric.compute())
            metric.reset()
        return values


SIZES = ("num_classes", "num_labels", "num_outputs")  # what torchmetrics' classes are built for


def _shown(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def build_metrics(node: Any) -> dict[str, Any]:
    """The node's metrics by name; an unknown class, or one that is not a torchmetrics.Metric, is one line."""
    if not node:
        return {}
    if importlib.util.find_spec("torchmetrics") is None:
        raise ConfigError("metrics: need torchmetrics, which is not installed; pip install 'hydraloop[metrics]'")
    from torchmetrics import Metric

    built = {}
    for name, spec in node.items():
        key = f"metrics.{name}"
        if not OmegaConf.is_dict(spec) and not isinstance(spec, Mapping) or "_target_" not in spec:
            raise ConfigError(f"{key}={spec}: must be a node with a _target_, e.g. torchmetrics.classification.F1Score")
        metric_class = _metric_class(key, str(spec["_target_"]))
        try:
            metric = instantiate(spec)
        except Exception as error:  # noqa: BLE001  the constructor's complaint, as one line
            cause = unwrap_instantiation(error)
            raise ConfigError(f"{key}: {metric_class.__name__} says: {str(cause).strip().splitlines()[0]}") from None
        if not isinstance(metric, Metric):
            raise ConfigError(f"{key}._target_={spec['_target_']}: not a torchmetrics.Metric")
        built[name] = metric
    return built


def _metric_class(key: str, target: str) -> type:
    found = _located(target)
    if found is None:
        import torchmetrics

        module = sys.modules.get(target.rpartition(".")[0])  # torchmetrics.classification, for a class typed there
        names = {name for place in (torchmetrics, module) for name in dir(place) if name[:1].isupper()}
        closest = difflib.get_close_matches(target.rsplit(".", 1)[-1], sorted(names), n=3, cutoff=0.6)
        hint = f"; closest in torchmetrics: {', '.join(closest)}" if closest else ""
        raise ConfigError(f"{key}._target_={target}: no such class{hint}")
    return found


def _located(target: str) -> type | None:
    """The class `module.Name` names, or None; quietly (hydra.utils.get_class logs an error of several lines)."""
    module_name, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except (ImportError, ValueError):
        return None
    return found if isinstance(found, type) else None


def metric_direction(node: Any, metric: str) -> str | None:
    """max or min for val/NAME where `metrics.NAME` is one of these (its class's higher_is_better), else None."""
    split = metric.split("/")
    spec = node.get(split[-1]) if node and len(split) >= 2 and split[0] == "val" else None
    if spec is None or "_target_" not in spec:
        return None
    found = _located(str(spec["_target_"]))  # None for an unknown class: build_metrics names it in the launcher
    if found is None:
        return None
    return "min" if getattr(found, "higher_is_better", True) is False else "max"
