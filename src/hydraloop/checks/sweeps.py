"""A `-m` command line's sweep or search, checked before its first job starts: the keys it varies are the run's (named
with the closest where not), an Optuna search's space, direction and trial count are as Optuna will build them, a
joblib launcher's `n_jobs` is not 0, and every job (the first MAX_CHECKED_JOBS) is composed and checked as the
launcher checks it, so that a bad value in one job is refused before any job has run.
"""

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hydraloop.checks.composition import composed, dotted_keys, resolved
from hydraloop.checks.config_values import check_required
from hydraloop.errors import ConfigError, first_line, require

OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
MAX_CHECKED_JOBS = 1000  # a larger sweep is checked in its first this many jobs


def sweep_jobs(parsed: list[Any], overrides: list[str]) -> list[list[str]]:
    """Every job of a basic sweep over the command line's overrides, as the basic sweeper makes them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # noqa: BLE001  an interval or tag sweep: a search's, not expandable; checked by its sweeper
        return [[item for item, override in zip(overrides, parsed) if not override.is_sweep_override()]]


def check_sweep(
    first: Any,
    jobs: list[list[str]],
    overrides: list[str],
    sweeps: list[str],
    conf_dir: Path,
    check_job: Callable[[Any], None],
) -> None:
    """The sweep of a `-m` command line's `overrides` (of which `sweeps` vary), inside Hydra's initialize_config_dir:
    its launcher, an Optuna search's space, the keys it varies (in `first`, its first job's composed config), then
    its `jobs` (sweep_jobs), each checked by `check_job`, the launcher's checks of one job's resolved config."""
    hydra = first.hydra
    _check_launcher(hydra)
    optuna = hydra.sweeper._target_ == OPTUNA_SWEEPER
    if optuna:  # its trials' values are the search's: checked as a space
        _check_optuna(hydra.sweeper, sweeps)
    _check_swept_keys(first, sweeps, (hydra.sweeper.get("params") or {}) if optuna else {}, conf_dir)
    if optuna:
        jobs = [[item for item in overrides if item not in sweeps]]
    for job in jobs[:MAX_CHECKED_JOBS]:
        try:
            check_job(_for_checks(composed(job)))
        except ConfigError as error:
            if len(jobs) == 1:
                raise
            shown = " ".join(job) or "(no overrides)"
            raise ConfigError(f"{error} (in the sweep's job {shown}; no job has run)") from None


def _for_checks(cfg: Any) -> Any:
    """A job's config as the launcher gets it: resolved, without the `hydra` node (whose run-time values the
    compose API leaves unset), the run directory standing in for Hydra's."""
    node = OmegaConf.to_container(cfg, resolve=False)
    node.pop("hydra", None)
    node["output_dir"], node["log_file"] = "/nonexistent", "/nonexistent/train.log"
    check_required(OmegaConf.create(node))
    return resolved(OmegaConf.create(node))


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
    keys = sorted(dotted_keys(run_config))
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
