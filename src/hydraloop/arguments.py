"""The config nodes the ranks build with `hydra.utils.instantiate`, checked in the launcher before any rank starts:
each key names an argument of the node's `_target_`, with a value of the kind its annotation says, and the values
its constructor refuses (the model's on the meta device, the optimizer's and scheduler's on one CPU parameter) are
refused there, in one line naming the key and the value.
"""

import collections.abc
import difflib
import importlib
import inspect
import types
import typing
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from hydraloop.errors import ConfigError, first_line, require, unwrap_instantiation
from hydraloop.optim import GROUPING_KEYS, config_key, optimizer_factory, optimizer_nodes

OVERLAYS = ("experiment", "hparams_search", "debug")  # `# @package _global_` groups: they set keys anywhere

# The config nodes the ranks build with hydra.utils.instantiate (some completed in code: the optimizer with the
# parameters, the scheduler with the step counts; only the keys the config gives are checked).
INSTANTIATED = ("parallel", "data.dataset", "data.check", "task", "model", "optimizer", "scheduler")


def check_arguments(cfg: Any) -> None:
    """Every key of a node built with `instantiate` names an argument its `_target_` takes, with a value of the kind
    its annotation says (a list where it takes a sequence, an integer where it takes an int, ...). Keys are free-form
    there (`+optimizer.weight_deacy=0.1` adds one), and a misspelt key, or `model.hidden_sizes=256` for a list, would
    otherwise fail in every rank, as a traceback from inside Hydra or the constructor."""
    several = [config_key(name) for name in optimizer_nodes(cfg.optimizer) if name]
    several += [f"{path}.scheduler" for path in several if OmegaConf.select(cfg, f"{path}.scheduler") is not None]
    for path in (*INSTANTIATED, *several, *_named_option_paths(cfg)):
        node = OmegaConf.select(cfg, path)
        if not OmegaConf.is_dict(node) or "_target_" not in node:
            continue
        target = _import_target(node._target_, f"{path}._target_")
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):  # a builtin without a signature: its own error will have to do
            continue
        annotations = _annotations(target)
        takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
        for key in node:
            if key.startswith("_") and key.endswith("_"):  # _partial_, _recursive_, ...
                continue
            if (
                path.split(".")[0] == "optimizer" and key in GROUPING_KEYS
            ):  # hydraloop's, not the optimizer's (hydraloop.optim)
                continue
            value = OmegaConf.select(node, key)
            if key not in parameters and not takes_any:
                close = difflib.get_close_matches(key, parameters, n=1)
                takes = f" (it takes {', '.join(parameters)})" if parameters else " (it takes none)"
                raise ConfigError(
                    f"{path}.{key}={value}{_set_by(f'{path}.{key}')}: {node._target_} takes no argument {key!r}"
                    + (f"; did you mean {close[0]}?" if close else takes)
                )
            problem = _type_problem(value, annotations.get(key, inspect.Parameter.empty))
            if problem:
                raise ConfigError(f"{path}.{key}={shown(value)}{_set_by(f'{path}.{key}')}: {problem} ({node._target_})")


def _set_by(key: str) -> str:
    """ " (set by experiment=text_gpt)" for a key the command line did not set, in a run with an overlay (an
    experiment, a search, a debug option) that may have: where to look for a value the user never typed."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    hydra = HydraConfig.get()
    if any(item.lstrip("+~").split("=")[0] == key for item in hydra.overrides.task):
        return ""
    overlays = [f"{group}={option}" for group in OVERLAYS if (option := hydra.runtime.choices.get(group))]
    return f" (set by {' or '.join(overlays)})" if overlays else ""


# Groups whose options each sit under their own name, so that several can be chosen; what a stray key there means.
NAMED_OPTIONS = {
    "logger": ("logger", "logger.wandb.{name}=... sets a W&B setting, with logger=wandb"),
    "callbacks": ("callback", "callbacks.ema.{name}=... sets an EMA setting, with callbacks=[ema]"),
}


def _named_option_paths(cfg: Any) -> list[str]:
    """`logger.<name>` for each logger chosen, `callbacks.<name>` for each callback; an entry that is not such a
    node is refused in one line."""
    paths = []
    for group, (kind, hint) in NAMED_OPTIONS.items():
        nodes = cfg.get(group)
        if not OmegaConf.is_dict(nodes) or "_target_" in nodes:
            continue
        for name, node in nodes.items():
            require(
                OmegaConf.is_dict(node) and "_target_" in node,
                f"{group}.{name}={shown(node)}: not a {kind}; the {group} chosen are nodes under {group}.<name> "
                f"({hint.format(name=name)})",
            )
            paths.append(f"{group}.{name}")
    return paths


def _annotations(target: Any) -> dict[str, Any]:
    """The argument annotations of a constructor or function, resolved where they are strings; {} where not."""
    function = target.__init__ if isinstance(target, type) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001  unresolvable forward references: check no types
        return {}


def _type_problem(value: Any, annotation: Any) -> str | None:
    """What is wrong with a config value for an argument annotated `annotation` ("must be a list"), or None. Only
    the kinds a config can hold are told apart; null is left to the constructor."""
    if value is None or annotation in (inspect.Parameter.empty, Any):
        return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, option) for option in typing.get_args(annotation) if option is not type(None)]
        return None if not problems or None in problems else problems[0]
    if annotation is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if annotation is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "must be a number"
    if annotation in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        return None if OmegaConf.is_list(value) else f"must be a list, e.g. [{shown(value)}]"
    if annotation is dict or origin in (dict, collections.abc.Mapping):
        return None if OmegaConf.is_dict(value) else "must be a mapping, e.g. {name: value}"
    return None


def shown(value: Any) -> str:
    return str(OmegaConf.to_container(value)) if OmegaConf.is_config(value) else str(value)


def _import_target(dotted: str, key: str) -> Any:
    """The object a `_target_` names (a module's attribute, or an attribute of one: module.Class.method)."""
    parts = str(dotted).split(".")
    import_error = None  # the longest module path's: what failed inside it, or that it does not exist
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module first
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError as error:
            import_error = import_error or str(error)
            continue
        try:
            for name in parts[split:]:
                target = getattr(target, name)
        except AttributeError as error:
            reason = import_error or str(error)
            break
        return target
    else:
        reason = import_error or f"{dotted!r} is not a dotted path to an object"
    raise ConfigError(f"{key}={dotted}: cannot import it: {reason}")


def check_model(model: Any) -> torch.nn.Module | None:
    """The model's checks of its values (an unknown torchvision arch, named weights not in the cache, a GPT's n_embd
    that does not split into heads, a dropout of 1.5), before any rank starts: its constructor, run on the meta
    device, which allocates nothing. Only bad input is reported here (a ConfigError, or a ValueError, see _refusal);
    whatever else a constructor cannot do on the meta device, the ranks meet for real. Returns the model built there
    (None where it could not be built)."""
    try:
        with torch.device("meta"):
            return instantiate(model)
    except Exception as error:  # noqa: BLE001  see above
        raise_refusal("model", model, unwrap_instantiation(error))
        return None


def check_optimization(
    optimizer: Any,
    scheduler: Any,
    max_steps: int | None = None,
    key: str = "optimizer",
    plan: tuple[int, int] | None = None,
) -> None:
    """The optimizer's and the scheduler's checks of their values (torch.optim's `Invalid beta parameter at index 1:
    1.5`), before any rank starts: their constructors, given one CPU parameter. Only bad input is reported, as for
    the model: what else an optimizer cannot do with a CPU parameter (a fused kernel that is GPU-only), the ranks meet
    for real. The schedule is planned as the ranks plan it where `plan` gives (its total steps, the steps per epoch),
    so that a warm-up in epochs longer than the run is refused here; else for `max_steps` where it is set, else for
    a run too long to refuse anything."""
    try:
        built = optimizer_factory(optimizer)([torch.zeros(1, requires_grad=True)])
    except Exception as error:  # noqa: BLE001  see above
        raise_refusal(key, optimizer, unwrap_instantiation(error))
        return
    total_steps, steps_per_epoch = plan or (max_steps or 2**62, 1)
    try:
        instantiate(scheduler)(built, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
    except Exception as error:  # noqa: BLE001  see above
        raise_refusal("scheduler", scheduler, unwrap_instantiation(error))


def raise_refusal(path: str, node: Any, cause: BaseException) -> None:
    """Raises bad input a constructor found in its config node as one line: its ConfigError (which names the key)
    as it is, and a ValueError (torch's and torchvision's own checks: `dropout probability has to be between 0 and
    1`) with the keys its message names, else all of the node's. Anything else is not reported here."""
    if isinstance(cause, ConfigError):
        raise cause from None
    if not isinstance(cause, ValueError):
        return
    reason = first_line(cause)
    keys = [key for key in node if not (key.startswith("_") and key.endswith("_"))]
    named = [key for key in keys if key.rstrip("s").lower() in reason.lower()] or keys
    values = ", ".join(f"{path}.{key}={OmegaConf.select(node, key)}" for key in named)
    raise ConfigError(f"{values}: {node._target_} says: {reason}") from None
