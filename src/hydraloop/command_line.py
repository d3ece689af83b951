"""The command line, checked before Hydra runs it, so that what Hydra would refuse over many lines (exit 1), or
accept and fail on later, is one line naming the key and the value (exit 2):

- the overrides Hydra's parser or composition rejects: a misspelt key, a value of the wrong type, a key of another
  option, an experiment that names a missing option, lacks `# @package _global_`, or is not valid YAML;
- a sweep (`a=1,2`) or a search (`hparams_search=...`) without `-m`;
- every job of a `-m` sweep, composed and checked as the launcher checks it, before the first job starts;
- an Optuna search space, direction or trial count that Optuna would refuse, and a joblib `n_jobs` of 0;
- a sweep or search over a key the config lacks (named with the closest), or over Hydra's own config;
- a run (or sweep) directory that cannot be made: a file in its way, an unwritable parent;
- `hydra.output_subdir`, which would have Hydra write `.hydra/` before any check (hydraloop.run_records).

Command lines with other Hydra flags (`--cfg`, `--config-dir`, `--info`, ...) are left to Hydra.
"""

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydraloop.arguments import OVERLAYS
from hydraloop.checks import check_group_options, check_required
from hydraloop.errors import ConfigError, first_line, require
from hydraloop.run_records import note_new_parents
from hydraloop.storage import check_makeable

MULTIRUN_FLAGS = ("-m", "--multirun")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
MAX_CHECKED_JOBS = 1000  # a larger sweep is checked in its first this many jobs


def check_command_line(args: list[str], conf_dir: Path, check_job: Callable[[Any], None]) -> None:
    """Raises ConfigError (one line) for what the module docstring lists. `check_job`: the launcher's checks of one
    job's resolved config (src/train.py's)."""
    flags = [arg for arg in args if arg.startswith("-")]
    overrides = [arg for arg in args if not arg.startswith("-")]
    if any(flag not in MULTIRUN_FLAGS for flag in flags) or any("searchpath" in item for item in overrides):
        return  # another config source or another kind of command: Hydra's
    multirun = bool(flags)
    check_group_options(overrides, conf_dir)
    parsed = _parsed(overrides)
    sweeps = [item for item, override in zip(overrides, parsed) if override.is_sweep_override()]
    require(
        multirun or not sweeps,
        f"{sweeps[0] if sweeps else ''}: a sweep; add -m to run one job per value (python src/train.py -m ...), or "
        "write a list as [a,b] and a string with a comma in quotes",
    )
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        jobs = _jobs(parsed, overrides) if multirun else [overrides]
        require(jobs, f"{' '.join(sweeps)}: the sweep has no value, so no job to run")
        _check_removed_keys(overrides)
        first = _composed(jobs[0])
        hydra = first.hydra
        search = hydra.runtime.choices.get("hparams_search")
        require(
            multirun or hydra.sweeper._target_ == BASIC_SWEEPER,
            f"hparams_search={search}: a search runs its trials as a sweep: add -m "
            f"(python src/train.py -m hparams_search={search})"
            if search
            else f"hydra/sweeper={hydra.runtime.choices.get('hydra/sweeper')}: a sweeper runs with -m",
        )
        require(
            hydra.output_subdir is None,
            f"hydra.output_subdir={hydra.output_subdir}: Hydra would write the config there before any check, also "
            "for a command that is then refused, over a finished run's; hydraloop writes .hydra/ itself once the run "
            "is accepted (hydraloop.run_records): leave it null",
        )
        folder_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        _check_output_folder(OmegaConf.select(first, folder_key), folder_key)
        note_new_parents(OmegaConf.select(first, folder_key))
        if not multirun:
            return  # the launcher checks this one job itself
        _check_launcher(hydra)
        optuna = hydra.sweeper._target_ == OPTUNA_SWEEPER
        if optuna:  # its trials' values are the search's: checked as a space
            _check_optuna(hydra.sweeper, sweeps)
        _check_swept_keys(first, sweeps, (hydra.sweeper.get("params") or {}) if optuna else {}, conf_dir)
        if optuna:
            jobs = [[item for item in overrides if item not in sweeps]]
        for job in jobs[:MAX_CHECKED_JOBS]:
            try:
                check_job(_for_checks(_composed(job)))
            except ConfigError as error:
                if len(jobs) == 1:
                    raise
                shown = " ".join(job) or "(no overrides)"
                raise ConfigError(f"{error} (in the sweep's job {shown}; no job has run)") from None


def _check_removed_keys(overrides: list[str]) -> None:
    """`~trainer` or `~data.batch_size`: a key of the typed schema, which every run reads (hydraloop.config)."""
    from hydraloop.config import DataConfig, TrainConfig, TrainerConfig

    schema = {
        "": [field.name for field in dataclasses.fields(TrainConfig)],
        "trainer": [field.name for field in dataclasses.fields(TrainerConfig)],
        "data": [field.name for field in dataclasses.fields(DataConfig)],
    }
    for item in overrides:
        if not item.startswith("~"):
            continue
        key = item[1:].split("=")[0]
        parent, _, name = key.rpartition(".")
        require(
            name not in schema.get(parent, ()),
            f"{item}: {key} is a key every run reads (hydraloop.config); set its value instead of removing it",
        )


def _parsed(overrides: list[str]) -> list[Any]:
    parser = OverridesParser.create()
    parsed = []
    for item in overrides:
        try:
            parsed.extend(parser.parse_overrides([item]))
        except HydraException as error:
            raise ConfigError(
                f"{item}: Hydra cannot parse it ({first_line(error)}); the grammar: "
                "https://hydra.cc/docs/advanced/override_grammar/basic"
            ) from None
    return parsed


def _jobs(parsed: list[Any], overrides: list[str]) -> list[list[str]]:
    """Every job of a basic sweep over the command line's overrides, as the basic sweeper makes them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # noqa: BLE001  an interval or tag sweep: a search's, not expandable; checked by its sweeper
        return [[item for item, override in zip(overrides, parsed) if not override.is_sweep_override()]]


def _composed(overrides: list[str]) -> Any:
    """The config Hydra will compose, with its `hydra` node; its errors as one line."""
    try:
        return compose("train", overrides=overrides, return_hydra_config=True)
    except Exception as error:  # noqa: BLE001  translated below, or re-raised
        raise ConfigError(_composition_error(error, overrides)) from None


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
    return [path for path in _dotted_keys(run_config) if path.rpartition(".")[2] == name and path != key][:2]


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


def _for_checks(cfg: Any) -> Any:
    """A job's config as the launcher gets it: resolved, without the `hydra` node (whose run-time values the
    compose API leaves unset), the run directory standing in for Hydra's."""
    node = OmegaConf.to_container(cfg, resolve=False)
    node.pop("hydra", None)
    node["output_dir"], node["log_file"] = "/nonexistent", "/nonexistent/train.log"
    check_required(OmegaConf.create(node))
    return resolved(OmegaConf.create(node))


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


def _check_output_folder(path: str, key: str) -> None:
    """The folder can be made and written: Hydra makes it before `main` runs, and a traceback is its refusal."""
    try:
        check_makeable(Path(str(path)), key)
    except ConfigError as error:
        raise ConfigError(str(error).replace(f"{key} {path}", f"{key}={path}", 1)) from None


def _check_launcher(hydra: Any) -> None:
    launcher = hydra.launcher
    if launcher.get("_target_") == JOBLIB_LAUNCHER:
        n_jobs = launcher.get("n_jobs")
        require(
            isinstance(n_jobs, int) and n_jobs != 0,
            f"hydra.launcher.n_jobs={n_jobs}: jobs at once: a positive number, or -1 for one per core",
        )


SEARCH_PARAMS = "hydra.sweeper.params."


def _check_swept_keys(config: Any, command_line_sweeps: list[str], search: Any, conf_dir: Path) -> None:
    """Each key a sweep or search varies is a key of the run's config. Hydra refuses a sweep over its own config
    (`hydra.sweeper.params.optimizer.lr=interval(...)` on the command line, where a search key is given as itself),
    and a key the config lacks fails in the first job, after the sweep has started (a search's, in every trial)."""
    run_config = OmegaConf.to_container(config, resolve=False)
    run_config.pop("hydra", None)
    keys = sorted(_dotted_keys(run_config))
    given = [(item, item.split("=", 1)[0]) for item in command_line_sweeps]
    given += [(f"{SEARCH_PARAMS}{name}={value}", str(name)) for name, value in search.items()]
    for item, key in given:
        if key.startswith(("+", "~")) or "/" in key or (conf_dir / key).is_dir():  # added, removed, or a group
            continue
        searched, value = key.removeprefix(SEARCH_PARAMS), item.split("=", 1)[1]
        found = searched in keys
        close = [] if found else difflib.get_close_matches(searched, keys, n=1)
        if key.startswith(SEARCH_PARAMS):  # on the command line
            lacks = "" if found else f"the config has no key {searched}, and "
            raise ConfigError(
                f"{item}: {lacks}a search key is given on the command line as itself, not under "
                f"hydra.sweeper.params: " + (f"did you mean {close[0]}={value}?" if close else f"{searched}={value}")
            )
        require(not key.startswith("hydra."), f"{item}: Hydra's own config cannot be swept, only the run's keys")
        require(found, f"{item}: the config has no key {searched}" + (f"; did you mean {close[0]}?" if close else ""))


def _dotted_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a config container, dotted (`optimizer.lr`), nodes and leaves alike."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield f"{prefix}{key}"
        yield from _dotted_keys(value, f"{prefix}{key}.")


def _check_optuna(sweeper: Any, command_line_sweeps: list[str]) -> None:
    """The search as the Optuna sweeper will build it: its space (Optuna's distributions), direction and budget."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    directions = sweeper.direction if OmegaConf.is_list(sweeper.direction) else [sweeper.direction]
    for direction in directions:
        require(
            str(direction) in ("minimize", "maximize"),
            f"hydra.sweeper.direction={direction}: must be minimize or maximize",
        )
    for key in ("n_trials", "n_jobs"):
        value = sweeper.get(key)
        require(isinstance(value, int) and value > 0, f"hydra.sweeper.{key}={value}: must be a positive integer")
    params = [f"{name}={value}" for name, value in (sweeper.get("params") or {}).items()]
    for item in [*params, *command_line_sweeps]:
        try:
            create_params_from_overrides([item])
        except Exception as error:  # noqa: BLE001  Optuna's and the sweeper's own refusals
            where = "hydra.sweeper.params." if item in params else ""
            reason = first_line(error) if str(error) else type(error).__name__
            raise ConfigError(f"{where}{item}: Optuna refuses it ({reason})") from None
