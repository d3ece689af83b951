"""The config as Hydra composes it and OmegaConf resolves it, their refusals said as one line naming the key and the
value: a misspelt key (with the closest one, in this node or another), a value of the wrong type, a key of another
option of the group, an option that does not exist, an experiment that lacks `# @package _global_`, a config file
that is not YAML (file and line), an interpolation that does not resolve.
"""

import difflib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import yaml
from hydra import compose
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydraloop.arguments import OVERLAYS
from hydraloop.errors import ConfigError, first_line


def composed(overrides: list[str]) -> Any:
    """The config Hydra will compose, with its `hydra` node; its errors as one line."""
    try:
        return compose("train", overrides=overrides, return_hydra_config=True)
    except Exception as error:  # noqa: BLE001  translated below, or re-raised
        raise ConfigError(_composition_error(error, overrides)) from None


def resolved(cfg: Any) -> Any:
    """`cfg` with every interpolation resolved, as a struct config; one that does not resolve (`${foo}`, an
    `${oc.env:...}` of a variable that is not set) is one line naming its key."""
    try:
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True), flags={"struct": True})
    except OmegaConfBaseException as error:
        own = next((e for e in _causes(error) if isinstance(e, ConfigError)), None)
        if own is not None:  # a resolver's own refusal (token_meta: a folder without meta.json), one line already
            raise ConfigError(first_line(own)) from None
        key = getattr(error, "full_key", None) or "the config"
        raise ConfigError(f"{key}: cannot resolve its value ({first_line(error)})") from None


def _composition_error(error: BaseException, overrides: list[str]) -> str:
    chain = list(_causes(error))
    yaml_error = next((e for e in chain if isinstance(e, yaml.YAMLError)), None)
    if yaml_error is not None:
        # Where the construct the parser could not finish began (a list's "[", say), else where it gave up.
        mark = getattr(yaml_error, "context_mark", None) or getattr(yaml_error, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark else "a config file"
        return f"{where}: not valid YAML ({getattr(yaml_error, 'problem', None) or first_line(yaml_error)})"
    if isinstance(error, MissingConfigException):
        return _missing_option(str(error), overrides)
    message = str(error)
    if message.startswith("Ambiguous value for argument"):
        item = message.split("'")[1]
        return f"{item}: a sweep; add -m to run one job per value, or write a list as [a,b] and a string in quotes"
    omegaconf_error = next((e for e in chain if isinstance(e, OmegaConfBaseException)), None)
    experiment = message.split("'")[1] if message.startswith("In '") else None
    if omegaconf_error is None:
        return first_line(error)
    key = getattr(omegaconf_error, "full_key", None) or ""
    if key == "experiment" and experiment:  # the file's keys went under `experiment.`: no package header
        return (
            f"{experiment.replace('/', '=')}: the file must begin with '# @package _global_', so that its keys "
            "apply to the whole config (conf/experiment/*.yaml all do)"
        )
    reason = _reason(omegaconf_error, key)
    if " has no key " in reason and "did you mean" not in reason:
        reason += _other_options_with(key, overrides)
    if experiment:  # the value is the file's, whatever the command line sets the key to after it
        value = getattr(omegaconf_error, "value", None)
        shown = f"{key}={value}" if value is not None else key
        return f"{shown} (set in {experiment.replace('/', '=')}): {reason}"
    given = next((item for item in overrides if item.lstrip("+~").split("=")[0] == key), key)
    return f"{given}: {reason}"


def _other_options_with(key: str, overrides: list[str]) -> str:
    """For a key the chosen option of a group lacks (`parallel.nproc_per_node` under parallel=single): the group's
    options that have it. Composes each option once: only on this failure path."""
    from hydra.core.global_hydra import GlobalHydra

    group, _, name = key.partition(".")
    loader = GlobalHydra.instance().config_loader()
    options = loader.get_group_options(group) if group and name else []
    others = [item for item in overrides if not item.lstrip("+~").startswith((f"{group}.", f"{group}="))]
    having = []
    for option in options:
        try:
            node = compose("train", overrides=[*others, f"{group}={option}"])[group]
        except Exception:  # noqa: BLE001  that option does not compose with the rest: not one to suggest
            continue
        if OmegaConf.is_dict(node) and name in node:
            having.append(f"{group}={option}")
    return f" (it is a key of {' and '.join(having)})" if having else ""


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


FREE_GROUPS = ("model", "optimizer", "scheduler")
"""Groups whose keys are their constructors' (the schema's type for them is Any): a key of one's own is added."""


def _reason(error: OmegaConfBaseException, key: str) -> str:
    """What an OmegaConf error says, as a reason: the key that does not exist (and the closest one), or the type."""
    text = first_line(error)
    parent, _, name = key.rpartition(".")
    node = getattr(error, "parent_node", None)
    if text.startswith("Key '") and " not in " in text:
        keys = [str(k) for k in node] if OmegaConf.is_dict(node) else []
        close = _closest(name, keys)
        elsewhere = [] if close else _paths_named(node, name, key)
        if close:
            hint = f"; did you mean {parent + '.' if parent else ''}{close}?"
        elif elsewhere:  # trainer.ckpt_path for the top-level ckpt_path, model.lr for optimizer.lr
            shown = [path if "." in path else f"{path}, at the top level" for path in elsewhere]
            hint = f"; did you mean {' or '.join(shown)}?"
        elif key.split(".")[0] in FREE_GROUPS:  # keys its constructor takes, not the schema's
            hint = _argument_hint(node, key, name)
        else:
            hint = ""
        return f"{parent or 'the config'} has no key {name!r}{hint}"
    for needle, reason in (
        ("could not be converted to Integer", "must be an integer"),
        ("could not be converted to Float", "must be a number"),
        ("is not a valid bool", "must be true or false"),
        ("is not a ListConfig, list or tuple", "must be a list, e.g. [1, 2]"),
        ("is not a subclass of", "is a group of settings (set its keys, e.g. trainer.max_epochs=3), not a value"),
    ):
        if needle in text:
            return reason
    return text


def _closest(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` most likely means: the closest spelling, or the one whose words' initials it is, or that
    are its initials (`learning_rate` for `lr`, `wd` for `weight_decay`)."""
    close = difflib.get_close_matches(name, candidates, n=1)
    if close:
        return close[0]
    initials = lambda words: "".join(word[:1] for word in words.split("_"))  # noqa: E731
    return next((c for c in candidates if initials(name) == c or initials(c) == name and "_" in c), None)


def _paths_named(node: Any, name: str, key: str) -> list[str]:
    """The config's other keys of this name (its run keys, not Hydra's): where a key given in the wrong place is."""
    root = node._get_root() if OmegaConf.is_config(node) else None  # noqa: SLF001  the whole composed config
    if root is None:
        return []
    run_config = OmegaConf.to_container(root, resolve=False)
    run_config.pop("hydra", None)
    return [path for path in dotted_keys(run_config) if path.rpartition(".")[2] == name and path != key][:2]


def _argument_hint(node: Any, key: str, name: str) -> str:
    """For a key the node of a model, optimizer or scheduler lacks: + adds it where its `_target_` takes it (or any
    keyword); else the argument it most likely means, or those it takes."""
    target = node.get("_target_") if OmegaConf.is_dict(node) else None
    module, _, attribute = str(target).rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module), attribute)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):  # not importable here: the + is the way to add it
        return f"; a key it lacks is added with a +: +{key}=..."
    if name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return f"; a key it lacks is added with a +: +{key}=..."
    names = [parameter for parameter in parameters if parameter not in ("self", "params")]
    meant = _closest(name, names)
    parent = key.rpartition(".")[0]
    return f"; did you mean {parent}.{meant}?" if meant else f" ({target} takes {', '.join(names) or 'none'})"


def _missing_option(message: str, overrides: list[str]) -> str:
    """Hydra's "In 'train': Could not find 'scheduler/cosin'", with the group's options, as one line. An overlay's
    `override /scheduler: cosin` is reported as the primary config's: the overlays on the command line are named."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = lines[0]
    where = head.split("'")[1] if head.startswith("In '") else ""
    missing = head.split("Could not find '")[-1].rstrip("'")
    group, _, option = missing.rpartition("/")
    options = [line for line in lines[2:] if not line.startswith(("Config search path", "provider="))]
    overlays = [item.lstrip("+") for item in overrides if item.lstrip("+").split("=")[0] in OVERLAYS]
    primary = not where or where == "train"
    source = (" or ".join(overlays) or "conf/train.yaml") if primary else where.replace("/", "=")
    return f"{source}: its defaults name {group}: {option}, not an option of {group} ({', '.join(options)})"


def dotted_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a config container, dotted (`optimizer.lr`), nodes and leaves alike."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield f"{prefix}{key}"
        yield from dotted_keys(value, f"{prefix}{key}.")
