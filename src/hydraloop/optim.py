"""The optimizers, from the `optimizer` config node and the model's named parameters, in parameter groups.

The node is one optimizer (it has a `_target_`), over every parameter; or several by name, `optimizer.<name>`, each
a node of its own with `modules`, the names of the submodules whose parameters it trains (a GAN's `[generator]` and
`[discriminator]`), and optionally a `scheduler` node of its own (else it follows the run's `scheduler`). Every
parameter belongs to exactly one of them. Internally one optimizer is named "". A parameter that does not require
gradients (frozen: model=hf's weights under LoRA adapters) belongs to none.

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

GROUPING_KEYS = ("no_weight_decay", "no_weight_decay_names", "lr_scales", "modules", "scheduler")


def schedule_node(node: Any, scheduler: Any) -> Any:
    """The schedule an optimizer follows: its own `scheduler` node (one of several may have one), else the run's."""
    own = node.get("scheduler") if OmegaConf.is_dict(node) else None
    return own if own is not None else scheduler


def optimizer_nodes(node: Any) -> dict[str, Any]:
    """The optimizers the `optimizer` node configures, by name: {"": node} for one, else its entries."""
    if not OmegaConf.is_dict(node) or "_target_" in node:
        return {"": node}
    return {str(name): sub for name, sub in node.items()}


def config_key(name: str) -> str:
    """Where an optimizer's settings are: `optimizer`, or `optimizer.<name>` for one of several."""
    return f"optimizer.{name}" if name else "optimizer"


def part_modules(node: Any) -> list[str]:
    """The submodules that several optimizers train, each its own part of the model (see the strategies' `wrap`);
    [] for one optimizer over the whole model."""
    nodes = optimizer_nodes(node)
    return [] if "" in nodes else [str(module) for sub in nodes.values() for module in sub.get("modules") or []]


def optimizer_factory(node: Any) -> Any:
    """The optimizer's constructor from its config node, without hydraloop's grouping keys: called with parameters
    (or groups) it returns the optimizer."""
    plain = OmegaConf.masked_copy(node, [key for key in node if key not in GROUPING_KEYS])
    return instantiate(plain)


def build_optimizers(node: Any, model: nn.Module) -> dict[str, Optimizer]:
    """Each optimizer the node configures, by name, over its part of `model`."""
    return {name: build_optimizer(sub, model) for name, sub in optimizer_nodes(node).items()}


def build_optimizer(node: Any, model: nn.Module) -> Optimizer:
    """The optimizer over `model`'s parameters (the user's module, unwrapped: its names carry no wrapper's prefix;
    under FSDP its parameters are the shards), or those of its `modules`, in the groups the node's grouping keys
    make."""
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
    for name, param in trained_parameters(model, node):
        decays = not (exempt and (param.ndim < 2 or name in own) or any(fnmatch.fnmatchcase(name, p) for p in names))
        scale = next((float(s) for pattern, s in scales.items() if fnmatch.fnmatchcase(name, pattern)), 1.0)
        group = groups.setdefault((decays, scale), {"params": []})
        group["params"].append(param)
        if not decays:
            group["weight_decay"] = 0.0
        if scale != 1.0:
            group["lr_scale"] = scale
    return list(groups.values())


def trained_parameters(model: nn.Module, node: Any) -> list[tuple[str, nn.Parameter]]:
    """The named parameters an optimizer's node trains: all of `model`'s, or those of its `modules`; of those, the
    ones that require gradients (a frozen parameter, e.g. under model.lora, has no optimizer state, and no weight
    decay moves it)."""
    modules = node.get("modules") if OmegaConf.is_dict(node) or isinstance(node, dict) else None
    prefixes = tuple(f"{module}." for module in modules) if modules is not None else ("",)
    return [(n, param) for n, param in model.named_parameters() if param.requires_grad and n.startswith(prefixes)]


def check_optimizers(node: Any, model: nn.Module) -> None:
    """Several optimizers: each a node of its own, whose `modules` name submodules of `model` (built on the meta
    device), every parameter trained by exactly one. Then each one's grouping keys. Bad input, in one line."""
    nodes = optimizer_nodes(node)
    claimed: dict[str, str] = {}
    for name, sub in nodes.items():
        if name:
            _check_part(name, sub, model, claimed)
        check_parameter_groups(sub, model, config_key(name))
    if "" not in nodes:
        unclaimed = [name for name, param in model.named_parameters() if param.requires_grad and name not in claimed]
        require(
            not unclaimed,
            f"optimizer: no optimizer trains {', '.join(unclaimed[:3])}{' ...' if len(unclaimed) > 3 else ''}: "
            f"add its module to the modules of one of {', '.join(f'optimizer.{n}' for n in nodes)}",
        )


def _check_part(name: str, sub: Any, model: nn.Module, claimed: dict[str, str]) -> None:
    key = config_key(name)
    require(
        name.isidentifier(),
        f"{key}: {name!r} cannot name an optimizer: a name is a key of the command line (optimizer.<name>.lr=...), "
        "letters, digits and underscores",
    )
    require(
        OmegaConf.is_dict(sub) and "_target_" in sub,
        f"{key}={sub}: not an optimizer; with several, each is a node optimizer.<name> with a _target_ and the "
        "modules it trains (docs/optimizers-and-callbacks.md)",
    )
    modules = sub.get("modules")
    require(
        OmegaConf.is_list(modules)
        and len(modules) > 0
        and all(isinstance(module, str) and module for module in modules),
        f"{key}.modules={modules}: must be a list of the submodules it trains, e.g. [generator]",
    )
    children = [child for child, _ in model.named_children()]
    for module in modules:
        try:
            model.get_submodule(module)
        except AttributeError:
            raise ConfigError(
                f"{key}.modules: {module!r} is no submodule of {type(model).__name__} (its children: "
                f"{', '.join(children)})"
            ) from None
    for param_name, _ in trained_parameters(model, sub):
        require(
            param_name not in claimed,
            f"{key}.modules={list(modules)}: {param_name} is trained by optimizer.{claimed.get(param_name)} too; "
            "give each parameter one optimizer",
        )
        claimed[param_name] = name


def check_parameter_groups(node: Any, model: nn.Module, key: str = "optimizer") -> None:
    """The grouping keys' values, and that every pattern matches a parameter the optimizer trains (`model` built on
    the meta device): bad input, in one line naming the key and the pattern."""
    _, names, scales = _rules(node, key)
    parameter_names = [name for name, _ in trained_parameters(model, node)]
    for rule, patterns in (("no_weight_decay_names", names), ("lr_scales", list(scales))):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in parameter_names):
                close = [name for name in parameter_names if pattern.strip("*").split(".")[0] in name][:3]
                raise ConfigError(
                    f"{key}.{rule}: the pattern {pattern!r} matches no parameter of {type(model).__name__} "
                    f"{'it trains ' if key != 'optimizer' else ''}(its names look like "
                    f"{', '.join(close or parameter_names[:3])})"
                )


def group_sizes(model: nn.Module, node: Any) -> list[int]:
    """How many parameters each group holds: what a checkpoint's optimizer state must match."""
    return [len(group["params"]) for group in parameter_groups(model, node)]


def _rules(node: Any, key: str = "optimizer") -> tuple[bool, list[str], dict[str, float]]:
    exempt = node.get("no_weight_decay", False)
    require(isinstance(exempt, bool), f"{key}.no_weight_decay={exempt}: must be true or false")
    names = node.get("no_weight_decay_names") or []
    require(
        OmegaConf.is_list(names) or isinstance(names, list),
        f"{key}.no_weight_decay_names={names}: must be a list of name patterns, e.g. ['*.bias']",
    )
    scales = _plain(node.get("lr_scales") or [])
    pairs = isinstance(scales, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in scales)
    require(pairs, f"{key}.lr_scales={scales}: must be a list of [pattern, scale] pairs, e.g. [[backbone.*,0.1]]")
    for pattern, scale in scales:
        require(
            isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf"),
            f"{key}.lr_scales={scales}: the scale of {pattern!r} is {scale}: must be a positive number",
        )
    return exempt, [str(name) for name in _plain(names)], {str(pattern): scale for pattern, scale in scales}


def _plain(value: Any) -> Iterable:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
