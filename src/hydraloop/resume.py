"""Resuming: which checkpoint a run starts from, and whether it fits the config, checked before any process starts.
What a run takes of it is hydraloop.restore's; the checkpoint's format, hydraloop.checkpoint's.

Where the checkpoint and the config differ, the config wins (hydraloop.restore), or the resume is refused in one
line: a checkpoint of another model, optimizer, parameter grouping, task or tokenizer, or of more steps than
trainer.max_steps; a mid-epoch checkpoint under another seed or sample order; a finished run's directory, which is
left as it is.
"""

import json
import logging
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from hydraloop.arguments import shown as shown_value
from hydraloop.checkpoint import load_checkpoint, of_each, step_checkpoints
from hydraloop.data.codec import token_maker
from hydraloop.errors import ConfigError
from hydraloop.optim import GROUPING_KEYS, config_key, group_sizes, optimizer_nodes
from hydraloop.restore import comparable, model_state
from hydraloop.sharded_checkpoint import tensor_shapes

log = logging.getLogger(__name__)


def checkpoint_to_resume(cfg: Any, report: bool = False) -> str | None:
    """The checkpoint a run starts from: with `resume=true`, this run directory's own last.pt if it has one (a
    restarted or requeued job, or the same command rerun into the same directory: it continues where it stopped),
    else `ckpt_path` (null: from scratch).

    A last.pt that cannot be read (truncated, empty; a sharded one with a shard missing or short) gives way to the
    newest readable step-named checkpoint beside it, with one warning line if `report` (the process that owns the
    run directory; every rank looks for itself).
    """
    directory = Path(cfg.output_dir) / "checkpoints"
    own = [directory / "last.pt", *(path for _, path in sorted(step_checkpoints(directory).items(), reverse=True))]
    # A link whose directory is gone (last.pt -> a removed step-named one) is an unreadable checkpoint, said so.
    own = [path for path in own if path.exists() or path.is_symlink()] if cfg.resume and cfg.mode == "train" else []
    unreadable = []
    for path in own:
        try:
            load_checkpoint(path, lazy=True)
        except ConfigError:
            unreadable.append(path.name)
            continue
        if unreadable and report:
            log.warning(
                "resume=true: %s cannot be read (truncated, or not a checkpoint): continuing from %s, the newest "
                "readable checkpoint in %s",
                ", ".join(unreadable),
                path.name,
                directory,
            )
        return str(path)
    # None readable: last.pt is the one to report (check_resumable says it cannot be read), if there is one.
    return str(own[0]) if own else cfg.ckpt_path


SOURCES = ("path", "dir", "level")  # the data keys that say where a text's tokens come from


def check_resumable(path: str | Path, cfg: Any) -> None:
    """Fail before any process starts if the checkpoint does not fit the configured model (and, to resume
    training, optimizer).

    The model is built on the meta device: shapes only, no memory, no initialisation cost.
    """
    # The run directory's own last.pt (resume=true) was not named by the user: say where it came from.
    own = path != cfg.ckpt_path
    source = f"resume=true: {path}" if own else f"ckpt_path={path}"
    hint = " (resume=false starts the run directory over)" if own else ""
    try:
        checkpoint = load_checkpoint(path, source, lazy=True)
    except ConfigError as error:
        raise ConfigError(f"{error}{hint}") from None
    if cfg.mode != "train":
        model_state(checkpoint, cfg.ckpt_weights, source)  # it holds the weights asked for
    if cfg.mode == "train":
        _check_optimizers(checkpoint, cfg, source, hint)
    _check_task(checkpoint, cfg, path, source, hint)
    saved_tokenizer = token_maker(checkpoint.get("config", {}).get("data", {}))
    tokenizer = token_maker(OmegaConf.to_container(cfg.data, resolve=True))
    if saved_tokenizer is not None and tokenizer != saved_tokenizer:
        kinds = (saved_tokenizer.get("kind"), (tokenizer or {}).get("kind"))
        what = f"another {kinds[0]} tokenizer" if kinds[0] == kinds[1] else f"another tokenizer ({kinds[0]})"
        if kinds == ("char", "char"):
            what = f"another vocabulary ({len(saved_tokenizer['vocab'])} characters, here {len(tokenizer['vocab'])})"
        given = [key for key in SOURCES if key in cfg.data.dataset]
        read_from = ", ".join(f"data.dataset.{key}={cfg.data.dataset[key]}" for key in given)
        raise ConfigError(
            f"{source}: was trained on tokens of {what} than {read_from or 'this data'} gives "
            f"({kinds[1]}): the token ids would mean other text{hint}"
        )
    done, max_steps = checkpoint["global_step"], cfg.trainer.max_steps
    if cfg.mode == "train" and max_steps is not None and max_steps < done:
        raise ConfigError(f"trainer.max_steps={max_steps}: below the {done} steps already done ({source}){hint}")
    saved_config = checkpoint.get("config") or {}
    if cfg.mode == "train" and checkpoint.get("epoch_step"):  # mid-epoch: the rest of the epoch is in its order
        for key, value in (("seed", cfg.seed), ("data.shuffle", cfg.data.shuffle)):
            before = OmegaConf.select(OmegaConf.create(saved_config), key, default=value)
            if before != value:
                now, then = (str(v).lower() if isinstance(v, bool) else v for v in (value, before))
                raise ConfigError(
                    f"{key}={now}: {source} is mid-epoch (step {checkpoint['epoch_step']} of epoch "
                    f"{checkpoint['epoch'] + 1}) under {key}={then}, and the rest of that epoch would take another "
                    f"order, repeating and leaving out samples; resume with {key}={then}{hint}"
                )
    model_cfg = cfg.model
    saved = tensor_shapes(checkpoint["model"])
    with torch.device("meta"):
        model = instantiate(model_cfg)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    problems = [f"missing {name}" for name in expected.keys() - saved.keys()]
    problems += [f"unexpected {name}" for name in saved.keys() - expected.keys()]
    problems += [
        f"{name} has shape {list(saved[name])}, model needs {list(shape)}"
        for name, shape in expected.items()
        if name in saved and saved[name] != shape
    ]
    if problems:
        shown = "; ".join(sorted(problems)[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ConfigError(f"{source}: does not fit model {model_cfg._target_} ({shown}){hint}")
    if cfg.mode == "train":
        _check_groups(checkpoint, cfg, model, source, hint)


def _check_task(checkpoint: dict[str, Any], cfg: Any, path: str | Path, source: str, hint: str) -> None:
    """The checkpoint was trained for the configured task: another reads the model's outputs otherwise (a language
    model's logits as class scores), and every later check (tokenizer, shapes) would name a consequence of it."""
    saved = checkpoint.get("config") or {}
    saved_task = (saved.get("task") or {}).get("_target_")
    if saved_task is None or saved_task == cfg.task._target_:
        return
    from hydraloop.trial import named_option

    # The options its run was composed of, where its run directory's .hydra/ is beside its checkpoints/ folder.
    hydra_file = Path(path).parent.parent / ".hydra" / "hydra.yaml"
    choices = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices") if hydra_file.is_file() else None
    if choices and choices.get("task") and choices.get("data"):
        trained = f"task={choices.task} on data={choices.data}"
    else:
        data_target = ((saved.get("data") or {}).get("dataset") or {}).get("_target_")
        trained = f"task._target_={saved_task} on data.dataset._target_={data_target}"
    raise ConfigError(
        f"{source}: was trained for {trained}, and this run is {named_option(cfg, 'task')} on "
        f"{named_option(cfg, 'data')}; give the data and task it was trained with{hint}"
    )


def _check_optimizers(checkpoint: dict[str, Any], cfg: Any, source: str, hint: str) -> None:
    """The checkpoint holds state of the optimizers the config names (several by name, hydraloop.optim), each of the
    same class."""
    nodes = optimizer_nodes(cfg.optimizer)
    saved_config = checkpoint.get("config") or {}
    saved_nodes = optimizer_nodes(OmegaConf.create(saved_config.get("optimizer") or {"_target_": None}))
    if saved_config and list(saved_nodes) != list(nodes):
        what = lambda names: " and ".join(f"optimizer.{n}" for n in names) if names != [""] else "one optimizer"  # noqa: E731
        raise ConfigError(
            f"{source}: holds the state of {what(list(saved_nodes))}, the config names {what(list(nodes))}{hint}"
        )
    for name, node in nodes.items():
        saved_target = saved_nodes[name].get("_target_") if name in saved_nodes else None
        if saved_target and saved_target != node._target_:
            raise ConfigError(f"{config_key(name)}._target_={node._target_}: {source} holds {saved_target} state{hint}")
        modules, saved_modules = (comparable(n.get("modules")) for n in (node, saved_nodes.get(name, node)))
        if modules != saved_modules:  # parts of the same shapes would take each other's moments silently
            raise ConfigError(
                f"{config_key(name)}.modules={list(modules or [])}: {source} holds its state for the modules "
                f"{list(saved_modules or [])}{hint}"
            )


def _check_groups(checkpoint: dict[str, Any], cfg: Any, model: nn.Module, source: str, hint: str) -> None:
    """Each optimizer's state is of the parameter groups the config makes."""
    nodes = optimizer_nodes(cfg.optimizer)
    for name, saved in of_each(checkpoint["optimizer"], list(nodes)).items():
        saved_groups = [len(group["params"]) for group in saved.get("param_groups", [])]
        groups = group_sizes(model, nodes[name])
        if not saved_groups or saved_groups == groups:
            continue
        key = config_key(name)
        values = {rule: nodes[name].get(rule) for rule in GROUPING_KEYS if rule not in ("modules", "scheduler")}
        rules = ", ".join(
            f"{key}.{rule}={str(v).lower() if isinstance(v, bool) else shown_value(v)}" for rule, v in values.items()
        )
        raise ConfigError(
            f"{rules}: make parameter groups of {groups} parameters, and {source} holds optimizer state for groups "
            f"of {saved_groups}; resume with the grouping it was trained with{hint}"
        )


def finished_records(path: str | Path | None, cfg: Any, composed: Any) -> dict[str, Any] | None:
    """A rerun of a finished run: its metrics.json, if `path` (this run directory's own checkpoint, resume=true) is
    the end of training under `cfg` and the run wrote its records. None: there is training (or a record) to do.
    Where the run left no checkpoint of its own (`path` None or another directory's), see `_finished_uncheckpointed`
    (`composed`: this run's config as Hydra composed it)."""
    metrics_file = Path(cfg.output_dir) / "metrics.json"
    if cfg.mode != "train" or not metrics_file.is_file():
        return None
    if not (path and is_own(path, cfg)):
        return _finished_uncheckpointed(cfg, composed) if cfg.resume else None
    checkpoint = load_checkpoint(path, lazy=True)
    max_steps = cfg.trainer.max_steps
    done = checkpoint["global_step"] >= max_steps if max_steps else checkpoint["epoch"] >= cfg.trainer.max_epochs
    if not (done or checkpoint.get("stopped_early")):
        return None
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, ValueError):
        return None  # a metrics.json that cannot be read is written again
    if metrics.get("global_step") != checkpoint["global_step"] or cfg.trainer.eval_best and "best/epoch" not in metrics:
        return None
    changed = _changed_keys(checkpoint.get("config") or {}, OmegaConf.to_container(cfg, resolve=True))
    if changed:
        more = f", and {'; '.join(changed[1:3])}" if len(changed) > 1 else ""
        raise ConfigError(
            f"{changed[0]}{more}: the run in {cfg.output_dir} finished at step {checkpoint['global_step']} under "
            "another config, and is left as it is: resume=false starts the directory over, or give this run a "
            "directory of its own"
        )
    return metrics


def _finished_uncheckpointed(cfg: Any, composed: Any) -> dict[str, Any] | None:
    """A rerun (resume=true) into the directory of a training run that finished (its metrics.json) without a
    checkpoint of its own to continue from (trainer.save_checkpoints=false, or its checkpoints removed): its
    metrics.json if this run's config is that run's (`.hydra/config.yaml` and `composed`, both as Hydra composed
    them, compared as `_changed_keys` compares, the budget included: nothing can continue that run). Another config
    is refused, as it is where the run's checkpoints are kept: training anew would replace the finished run's
    records."""
    from hydraloop.run_records import HYDRA_SUBDIR

    run_dir = Path(cfg.output_dir)
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return None  # not written whole: no finished run
    step = metrics.get("global_step")
    keep = "resume=false starts the directory over, or give this run a directory of its own"
    try:
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / HYDRA_SUBDIR / "config.yaml"))
    except Exception:  # noqa: BLE001  missing, or not a config (OSError, YAML's and OmegaConf's errors)
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"run directory {cfg.output_dir}: holds the records of a run that finished at step {step}, without its "
            f"{HYDRA_SUBDIR}/config.yaml or a checkpoint of its own to continue from; they are left as they are: {keep}"
        )
    if saved.get("mode", "train") != "train":
        return None  # an evaluation's records (mode=eval), not a training run's
    changed = _changed_keys(saved, OmegaConf.to_container(composed), ignored=())
    if not changed:
        return metrics
    more = f", and {'; '.join(changed[1:3])}" if len(changed) > 1 else ""
    raise ConfigError(
        f"{changed[0]}{more}: the run in {cfg.output_dir} finished at step {step} under another config, without a "
        f"checkpoint of its own to continue from, and is left as it is: {keep}"
    )


BUDGET = ("trainer.max_epochs", "trainer.max_steps")


def _changed_keys(saved: dict[str, Any], now: dict[str, Any], ignored: tuple[str, ...] = BUDGET) -> list[str]:
    """`key=now (was: saved)` for each key of what defines the trained model and what is measured of it (data,
    model, task, optimizer, scheduler, seed, trainer, callbacks, optimized_metric) whose value differs between a
    checkpoint's config and this run's, but the `ignored` keys. By default the budget (trainer.max_epochs,
    max_steps): the caller has found the run done under this one (or stopped early)."""
    from hydraloop.loggers.base import flatten

    parts = ("data", "model", "task", "optimizer", "scheduler", "seed", "trainer", "callbacks", "optimized_metric")
    before, after = ({k: v for k, v in flatten(c).items() if k.split(".")[0] in parts} for c in (saved, now))
    return [
        f"{key}={after.get(key)} (was {before.get(key)})"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key) and key not in ignored
    ]


def is_own(path: str | Path, cfg: Any) -> bool:
    """Whether `path` is one of this run directory's own checkpoints."""
    return Path(path).resolve().parent == (Path(cfg.output_dir) / "checkpoints").resolve()
