"""The optimizer, from the `optimizer` config node and the model's named parameters, in parameter groups.

Besides its optimizer's own arguments, the node may hold the keys below, which hydraloop reads and the optimizer
never sees:

- `no_weight_decay: true`: no weight decay on parameters of fewer than two dimensions (biases, norm weights: the rule
  of timm's `param_groups_weight_decay`, nanoGPT and Hugging Face's Trainer) and on those the model names in its own
  `no_weight_decay()` (timm's convention, e.g. position embeddings).
- `no_weight_decay_names: [pattern, ...]`: no weight decay on parameters whose name matches one of these
  `fnmatch` patterns too (embeddings: `["*embedding.weight"]`).
- `lr_scales: [[pattern, scale], ...]`: the lr times `scale` for parameters whose name matches `pattern`, the first
  pattern that matches in the order given (a backbone at a tenth: `[[backbone.*, 0.1]]`; layer-wise decay: a pattern
  per layer). Pairs, not a mapping: a dotted name as a key would be read as a path. The schedule scales every group
  alike.

Parameters that share a decay and a scale form one group, in the order of their first parameter, so the same config
makes the same groups under every strategy: a checkpoint's optimizer state (keyed by position across groups) fits
any of them. A pattern that matches no parameter is bad input, refused in the launcher.
"""

import fnmatch
from collections.abc import Iterable
from typing import Any

from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch.optim import Optimizer

from hydraloop.errors import ConfigError, require

GROUPING_KEYS = ("no_weight_decay", "no_weight_decay_names", "lr_scales")


def optimizer_factory(node: Any) -> Any:
    """The optimizer's constructor from its config node, without hydraloop's grouping keys: called with parameters
    (or groups) it returns the optimizer."""
    plain = OmegaConf.masked_copy(node, [key for key in node if key not in GROUPING_KEYS])
    return instantiate(plain)


def build_optimizer(node: Any, model: nn.Module) -> Optimizer:
    """The optimizer over `model`'s parameters (the user's module, unwrapped: its names carry no wrapper's prefix;
    under FSDP its parameters are the shards) in the groups the node's grouping keys make."""
    groups = parameter_groups(model, node)
    optimizer = optimizer_factory(node)(groups)
    for group in optimizer.param_groups:  # filled in with the optimizer's defaults (lr) by now
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)
    return optimizer


def parameter_groups(model: nn.Module, node: Any) -> list[dict[str, Any]]:
    """The parameter groups: dicts of `params`, and `weight_decay: 0.0` and `lr_scale` where they apply."""
    exempt, names, scales = _rules(node)
    own = set(model.no_weight_decay()) if exempt and callable(getattr(model, "no_weight_decay", None)) else set()
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        decays = not (exempt and (param.ndim < 2 or name in own) or any(fnmatch.fnmatchcase(name, p) for p in names))
        scale = next((float(s) for pattern, s in scales.items() if fnmatch.fnmatchcase(name, pattern)), 1.0)
        group = groups.setdefault((decays, scale), {"params": []})
        group["params"].append(param)
        if not decays:
            group["weight_decay"] = 0.0
        if scale != 1.0:
            group["lr_scale"] = scale
    return list(groups.values())


def check_parameter_groups(node: Any, model: nn.Module) -> None:
    """The grouping keys' values, and that every pattern matches a parameter of `model` (built on the meta device):
    bad input, in one line naming the key and the pattern."""
    _, names, scales = _rules(node)
    parameter_names = [name for name, _ in model.named_parameters()]
    for key, patterns in (("no_weight_decay_names", names), ("lr_scales", list(scales))):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in parameter_names):
                close = [name for name in parameter_names if pattern.strip("*").split(".")[0] in name][:3]
                raise ConfigError(
                    f"optimizer.{key}: the pattern {pattern!r} matches no parameter of {type(model).__name__} "
                    f"(its names look like {', '.join(close or parameter_names[:3])})"
                )


def group_sizes(model: nn.Module, node: Any) -> list[int]:
    """How many parameters each group holds: what a checkpoint's optimizer state must match."""
    return [len(group["params"]) for group in parameter_groups(model, node)]


def _rules(node: Any) -> tuple[bool, list[str], dict[str, float]]:
    exempt = node.get("no_weight_decay", False)
    require(isinstance(exempt, bool), f"optimizer.no_weight_decay={exempt}: must be true or false")
    names = node.get("no_weight_decay_names") or []
    require(
        OmegaConf.is_list(names) or isinstance(names, list),
        f"optimizer.no_weight_decay_names={names}: must be a list of name patterns, e.g. ['*.bias']",
    )
    scales = _plain(node.get("lr_scales") or [])
    pairs = isinstance(scales, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in scales)
    require(pairs, f"optimizer.lr_scales={scales}: must be a list of [pattern, scale] pairs, e.g. [[backbone.*,0.1]]")
    for pattern, scale in scales:
        require(
            isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf"),
            f"optimizer.lr_scales={scales}: the scale of {pattern!r} is {scale}: must be a positive number",
        )
    return exempt, [str(name) for name in _plain(names)], {str(pattern): scale for pattern, scale in scales}


def _plain(value: Any) -> Iterable:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
