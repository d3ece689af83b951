"""The run's data sets and task, built in the launcher and checked together: the data sets as the ranks will get
them (what their constructors refuse, their sizes against the batch, a batch of their first rows through the model,
the task and the metrics: hydraloop.trial), the task's fit to the data, model and optimizers, its metrics, and that it
or a callback reports `optimized_metric`.
"""

import inspect
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset, default_collate

from hydraloop.arguments import raise_refusal
from hydraloop.batches import check_leaves
from hydraloop.callbacks import reported_metrics
from hydraloop.errors import require, unwrap_instantiation
from hydraloop.metrics import MetricSet
from hydraloop.optim import optimizer_nodes
from hydraloop.seeding import seeded_build
from hydraloop.trial import try_batch


def check_data(cfg: Any, task: Any) -> int:
    """The data sets as the ranks will get them: built here (milliseconds for the in-memory ones), so that what their
    constructors refuse (a file's contents, a split, a text shorter than a sample) and what does not fit the batch or
    the task is one line before any rank starts. A data set too costly to build twice gives `data.check` instead, a
    cheaper check of its own (an image folder's: its layout, and one image through both transform lists). Returns
    the training set's size."""
    from hydraloop.data.loaders import check_sizes

    train_set, val_set = built(cfg, "data.dataset")
    check_sizes(train_set, val_set, cfg.data.batch_size, cfg.data.drop_last)
    where = f"data.dataset._target_={cfg.data.dataset._target_}"
    collate = getattr(train_set, "collate_fn", default_collate)  # a data set's own (data=hf pads its token rows)
    check_batch(cfg, task, collate([train_set[index] for index in range(min(2, len(train_set)))]), where)
    task.check_sample(train_set[0], where)
    if isinstance(train_set, TensorDataset):  # every label at once, in memory: a range the trial rows cannot show
        task.check_all_targets(train_set.tensors[-1], where)
    return len(train_set)


def check_batch(cfg: Any, task: Any, batch: Any, where: str) -> None:
    """A batch of the training set's first samples: tensors that agree on their rows, which the model, the task and
    every configured metric can take (hydraloop.trial: on the meta device, else on the CPU where that is cheap)."""
    check_leaves(batch, where)
    try_batch(cfg, task, batch)


def built(cfg: Any, path: str) -> Any:
    """The node at `path`, built; what its constructor refuses as one line (see arguments.raise_refusal)."""
    node = OmegaConf.select(cfg, path)
    try:
        return seeded_build(node, cfg.seed)  # as the ranks build it (a random_split draws the same samples)
    except Exception as error:  # noqa: BLE001  bad input is reported, anything else raised
        raise_refusal(path, node, unwrap_instantiation(error))
        raise


def check_task(cfg: Any, task: Any, callbacks: dict, world_size: int = 1) -> None:
    """The task fits the data and model (on `world_size` ranks), and it or a callback reports `optimized_metric`."""
    task.check(cfg)
    _check_optimizer_steps(cfg, task)
    if task.global_batch_loss:
        _check_global_batch(cfg, world_size)
    task.extra_metrics = MetricSet(cfg.metrics, torch.device("cpu"))  # each one built: bad input is found here
    own = task.reported_metrics()
    for name in task.extra_metrics.names if task.extra_metrics else []:
        require(
            name not in own,
            f"metrics.{name.removeprefix('val/')}: {name} is the task's own metric, which it would overwrite (the "
            f"task reports {', '.join(own)}); give it another name",
        )
    metric, reported = cfg.optimized_metric, reported_metrics(task.all_metrics(), callbacks)
    require(metric in reported, f"optimized_metric={metric}: the task reports {', '.join(reported)}")


def _check_global_batch(cfg: Any, world_size: int) -> None:
    """A loss over the global batch (hydraloop.global_batch): one optimizer, and validation batches that split
    evenly over the ranks (the global validation batch is then one process's, for in-batch negatives)."""
    where = f"task._target_={cfg.task._target_}"
    require(
        not [name for name in optimizer_nodes(cfg.optimizer) if name],
        f"{where}: a loss over the global batch trains with one optimizer (the optimizer node names several)",
    )
    val_batch_size = cfg.data.val_batch_size or cfg.data.batch_size
    require(
        val_batch_size % world_size == 0,
        f"data.val_batch_size={val_batch_size}: {where} computes its loss over the whole validation batch, which "
        f"must split evenly over the {world_size} ranks (as data.batch_size does)",
    )


STEPS_ORDERED = 1000  # the steps whose order the launcher asks the task for: an optimizer it never names is bad input


def _check_optimizer_steps(cfg: Any, task: Any) -> None:
    """Several optimizers need a task with a loss per optimizer, that steps each of them (and no other); one optimizer
    a task whose loss needs no optimizer's name."""
    names = [name for name in optimizer_nodes(cfg.optimizer) if name]
    takes = inspect.signature(task.training_loss).parameters.get("optimizer")
    where = f"task._target_={cfg.task._target_}"
    if not names:
        require(
            takes is None or takes.default is not inspect.Parameter.empty,
            f"{where}: its training_loss takes a loss per optimizer (optimizer=...), and the optimizer node is one "
            "optimizer: give several by name, as optimizer=gan does (docs/optimizers-and-callbacks.md)",
        )
        return
    require(
        takes is not None,
        f"optimizer: {' and '.join(f'optimizer.{name}' for name in names)} each need a loss of their own, and "
        f"{where} has one: its training_loss takes no optimizer argument (docs/optimizers-and-callbacks.md)",
    )
    stepped: set[str] = set()
    for step in range(STEPS_ORDERED):
        stepped.update(task.optimizer_steps(step, list(names)))
    unknown = sorted(stepped - set(names))
    require(
        not unknown,
        f"{where}: its optimizer_steps names {', '.join(map(repr, unknown))}, which the optimizer node does not have "
        f"(it has {', '.join(names)})",
    )
    never = [name for name in names if name not in stepped]
    require(
        not never,
        f"optimizer.{never[0] if never else ''}: {where} never steps it in its first {STEPS_ORDERED} steps (its "
        f"optimizer_steps names {', '.join(sorted(stepped))}), so it would train nothing",
    )
