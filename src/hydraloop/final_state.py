"""What a finished run leaves to compare with another (hydraloop.exactness): its final checkpoint (a file, or
parallel=fsdp's directory of shards, gathered whole by hydraloop.checkpoint.load_checkpoint) and the metrics it wrote
(`metrics.json`, and `metrics.csv` step by step where logger=csv wrote one), as flat {name: value} per part: the
model's parameters and buffers; the optimizers' state (by parameter name, where the model can be built on the meta
device to name the positions), their parameter groups and schedules; the callbacks' state (EMA's average); the
metrics, but for those that differ by design."""

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Written by every run and different by design: the world size, and timings (perf/..., train/samples_per_sec).
UNCOMPARED_METRICS = ("wall_time_s", "world_size")


def compared(metric: str) -> bool:
    return metric not in UNCOMPARED_METRICS and not metric.startswith("perf/") and not metric.endswith("_per_sec")


@dataclass
class FinalState:
    """What a finished run leaves to compare: its last checkpoint and its metrics, as flat {name: value} per part."""

    parts: dict[str, dict[str, Any]]
    global_step: int


def final_state(run_dir: str | Path) -> FinalState:
    """The run's `checkpoints/last.pt` (file or shards, gathered) and its metrics, by part."""
    from hydraloop.checkpoint import load_checkpoint

    run_dir = Path(run_dir)
    checkpoint = load_checkpoint(run_dir / "checkpoints" / "last.pt", source=str(run_dir / "checkpoints" / "last.pt"))
    config = checkpoint.get("config") or {}
    optimizer = dict(_optimizer_entries(checkpoint, config))
    metrics = {
        name: value for name, value in json.loads((run_dir / "metrics.json").read_text()).items() if compared(name)
    }
    metrics.update(_logged(run_dir / "metrics.csv"))
    parts = {
        "parameters": dict(checkpoint["model"]),
        "optimizer": optimizer,
        "callbacks": dict(_flat(checkpoint.get("callbacks") or {}, "")),
        "metrics": metrics,
    }
    return FinalState(parts, checkpoint["global_step"])


def _optimizer_entries(checkpoint: dict[str, Any], config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each optimizer's state by parameter name (`exp_avg[head.weight]`), its groups' settings, its schedule's state,
    and the fp16 loss scaler's."""
    from omegaconf import OmegaConf

    from hydraloop.checkpoint import of_each
    from hydraloop.optim import optimizer_nodes

    nodes = optimizer_nodes(OmegaConf.create(config["optimizer"])) if config.get("optimizer") else {"": None}
    names = list(nodes)
    param_names = _parameter_names(config, nodes)
    schedulers = of_each(checkpoint["scheduler"], names)
    for name, saved in of_each(checkpoint["optimizer"], names).items():
        prefix = f"{name}." if name else ""
        positions = param_names.get(name) or []
        for position, values in saved["state"].items():
            param = positions[position] if position < len(positions) else f"#{position}"
            for key, value in _flat(values, ""):
                yield f"{prefix}{key}[{param}]", value
        for index, group in enumerate(saved["param_groups"]):
            settings = {key: value for key, value in group.items() if key != "params"}
            yield from _flat(settings, f"{prefix}param_groups.{index}")
        yield from _flat(schedulers[name], f"{prefix}scheduler")
    yield from _flat(checkpoint.get("grad_scaler") or {}, "grad_scaler")


def _parameter_names(config: dict[str, Any], nodes: dict[str, Any]) -> dict[str, list[str]]:
    """Each optimizer's parameters' names in the order its state counts them (across its groups), from the model
    built on the meta device; {} where it cannot be built here (the state is then named by position)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from hydraloop.optim import parameter_groups

    try:
        with torch.device("meta"):
            model = instantiate(OmegaConf.create(config["model"]))
        named = {id(param): name for name, param in model.named_parameters()}
        return {
            name: [named[id(param)] for group in parameter_groups(model, node) for param in group["params"]]
            for name, node in nodes.items()
        }
    except Exception:  # a model that needs files or packages this process lacks: positions still compare
        return {}


def _logged(path: Path) -> dict[str, float]:
    """metrics.csv's values as `name@step`, but for the timings."""
    if not path.is_file():
        return {}
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {
        f"{name}@{row['step']}": float(value)
        for row in rows
        for name, value in row.items()
        if name != "step" and value != "" and compared(name)
    }


def _flat(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple) and not all(isinstance(item, int | float) for item in tree):
        for index, value in enumerate(tree):
            yield from _flat(value, f"{prefix}.{index}")
    else:
        yield prefix, tree
