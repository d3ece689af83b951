"""The command line, checked before Hydra runs it, so that what Hydra would refuse over many lines (exit 1), or
accept and fail on later, is one line naming the key and the value (exit 2):

- the overrides Hydra's parser or composition rejects: a misspelt key, a value of the wrong type, a key of another
  option, an experiment that names a missing option, lacks `# @package _global_`, or is not valid YAML
  (hydraloop.checks.composition);
- a sweep (`a=1,2`) or a search (`hparams_search=...`) without `-m`;
- every job of a `-m` sweep, composed and checked as the launcher checks it, before the first job starts;
- an Optuna search space, direction or trial count that Optuna would refuse, and a joblib `n_jobs` of 0;
- a sweep or search over a key the config lacks (named with the closest), or over Hydra's own config
  (these three: hydraloop.checks.sweeps);
- a run (or sweep) directory that cannot be made: a file in its way, an unwritable parent;
- `hydra.output_subdir`, which would have Hydra write `.hydra/` before any check (hydraloop.run_records).

Command lines with other Hydra flags (`--cfg`, `--config-dir`, `--info`, ...) are left to Hydra.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from omegaconf import OmegaConf

from hydraloop.checks.composition import composed
from hydraloop.checks.sweeps import check_sweep, sweep_jobs
from hydraloop.errors import ConfigError, first_line, require
from hydraloop.run_records import note_new_parents
from hydraloop.storage import check_makeable

MULTIRUN_FLAGS = ("-m", "--multirun")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


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
        jobs = sweep_jobs(parsed, overrides) if multirun else [overrides]
        require(jobs, f"{' '.join(sweeps)}: the sweep has no value, so no job to run")
        _check_removed_keys(overrides)
        first = composed(jobs[0])
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
        check_sweep(first, jobs, overrides, sweeps, conf_dir, check_job)


def check_group_options(args: list[str], conf_dir: Path) -> None:
    """`logger=foo` or `-m optimizer=adamw,sgdd`: an option that is neither a file of its group in `conf_dir` nor
    registered in Hydra's ConfigStore is one line listing the group's options, exit 2. Run on the command line's
    overrides before Hydra composes, whose own error for it spans several lines and exits 1. Hydra's groups
    (hydra/...) and a command line that adds config folders (--config-dir, hydra.searchpath) are left to Hydra, as
    is anything Hydra's parser rejects."""
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    if any(arg.startswith(("-cd", "--config-dir")) for arg in args) or any("searchpath" in o for o in overrides):
        return
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    for override in parsed:
        group = conf_dir / override.key_or_group
        if override.is_delete() or override.key_or_group.startswith("hydra") or not group.is_dir():
            continue
        options = sorted(_group_options(group, override.key_or_group))
        for option in _option_names(override.value()):
            require(
                option in options,
                f"{override.input_line}: {option!r} is not an option of {override.key_or_group} ({', '.join(options)})",
            )


def _group_options(folder: Path, group: str) -> set[str]:
    """The group's yaml files, and the options registered in Python (Hydra's ConfigStore)."""
    options = {str(path.relative_to(folder).with_suffix("")) for path in folder.rglob("*.yaml")}
    with contextlib.suppress(OSError):  # OSError: none registered
        options |= {name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)}
    return options


def _option_names(value: Any) -> Iterator[str]:
    """The options an override's value names: one, a list (`logger=[csv,wandb]`) or a choice sweep (`a,b`)."""
    if isinstance(value, ChoiceSweep):
        value = value.list
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _option_names(item)
    elif isinstance(value, str):  # null, numbers, globs and ranges: not option names, left to Hydra
        yield value


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


def _check_output_folder(path: str, key: str) -> None:
    """The folder can be made and written: Hydra makes it before `main` runs, and a traceback is its refusal."""
    try:
        check_makeable(Path(str(path)), key)
    except ConfigError as error:
        raise ConfigError(str(error).replace(f"{key} {path}", f"{key}={path}", 1)) from None
