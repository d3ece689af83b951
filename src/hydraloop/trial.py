"""The launcher's trial batch: the training set's first rows through the model's forward, the task's training loss and
validation statistics, and every configured metric's update and compute, before any rank starts. What cannot take
what it is given (a 1-channel image for an RGB network, float pixels for a token embedding, 10-class logits for a
binary F1 score) is one line naming the model or the metric key, the shapes and dtypes it was given, and what it
said it expected; otherwise each rank would meet it at the first step or the first validation, as a traceback, with
the run directory written.

The trial runs on the meta device, which computes shapes and allocates nothing: free for any model size. What the
meta device cannot run (`.item()`, data-dependent shapes: a transformers model's mask checks, a GAN's mode counts)
runs again on the CPU, with the model built there, where that is cheap (CPU_TRIAL_PARAMETERS); a model both cannot
try is left to the ranks. An error the meta device gives is confirmed on the CPU where that is cheap, for the CPU
kernels' messages (which say what was expected), and so that a shape the meta device alone refuses refuses nothing.
"""

import contextlib
import logging
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from hydraloop.arguments import check_model
from hydraloop.batches import map_tensors, tensors
from hydraloop.errors import ConfigError, first_line
from hydraloop.optim import optimizer_nodes

log = logging.getLogger(__name__)

CPU_TRIAL_PARAMETERS = 30_000_000
"""The largest model the launcher builds on the CPU for its trial: a few seconds at most on a busy core (a ResNet-50's
25M parameters; GPT-2's 124M take 6-13 s there). Only where the meta device could not answer, or refused."""


class _Trial:
    """One trial of the model and task on a batch: where it failed (the model's forward, the task on the model's
    outputs, or elsewhere in the task), with what the model was given and gave, and what the metrics were given."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.model_inputs: Any = None  # the model's positional and keyword arguments, at its last call
        self.model_outputs: Any = None
        self.in_model = False  # the model's forward was running when the error came
        self.metric_inputs: tuple[Tensor, Tensor] | None = None  # what validation updates the metrics with
        self.batch: Any = None
        self.on_meta = False


class _MetricInputs:
    """Stands in for the task's `extra_metrics` in a trial: keeps what validation would update the metrics with."""

    def __init__(self, trial: _Trial) -> None:
        self.trial = trial

    def update(self, predictions: Tensor, targets: Tensor) -> None:
        self.trial.metric_inputs = (predictions, targets)


def try_batch(cfg: Any, task: Any, batch: Any) -> None:
    """The trial of `batch` (on the CPU, as the data set gives it) for `cfg`'s model, `task` and metrics: raises
    ConfigError, one line, for what cannot run."""
    model = check_model(cfg.model)  # on the meta device; what its constructor refuses is one line here too
    if model is None:  # its constructor needs a real device (reads weights, say): the ranks build it
        return
    trial = _run(model, task, cfg, map_tensors(lambda tensor: tensor.to("meta"), batch))
    if trial.error is not None and sum(parameter.numel() for parameter in model.parameters()) <= CPU_TRIAL_PARAMETERS:
        trial = _on_cpu(cfg, task, batch) or trial  # the CPU's answer, where it has one: no error, or its own words
    if trial.error is not None:
        if trial.on_meta and _meta_cannot(trial.error):  # neither device can answer: the ranks will
            log.debug("the trial batch is left to the ranks: %s", first_line(trial.error))
            return
        raise ConfigError(_message(cfg, task, trial))
    if trial.metric_inputs is not None:
        task.extra_metrics.check(*_stand_ins(*trial.metric_inputs), f"{named_option(cfg, 'task')}'s outputs")


def _on_cpu(cfg: Any, task: Any, batch: Any) -> _Trial | None:
    """The trial with the model built on the CPU (the launcher's random state left as it was); None where the model
    cannot be built there (a constructor that needs a GPU, say): then the meta device's answer stands."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = instantiate(cfg.model)
        except Exception:  # noqa: BLE001  what its constructor refuses was said on the meta device
            return None
        return _run(model, task, cfg, batch)


def _run(model: torch.nn.Module, task: Any, cfg: Any, batch: Any) -> _Trial:
    """The task's training loss (per optimizer, for several) in training mode, then its validation statistics in
    evaluation mode, with the metric inputs kept."""
    trial = _Trial()
    trial.batch, trial.on_meta = batch, any(tensor.is_meta for _, tensor in tensors(batch))
    names = [name for name in optimizer_nodes(cfg.optimizer) if name]
    metrics, task.extra_metrics = task.extra_metrics, None
    if metrics:
        task.extra_metrics = _MetricInputs(trial)
    try:
        with _watched(model, trial), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a model's notes on its first call: the ranks say them
            model.train()
            for name in names or [None]:  # with gradients, as in training: a loss may take some (a penalty)
                task.training_loss(model, batch, **({"optimizer": name} if name else {}))
            model.eval()
            with torch.no_grad():
                task.validation_statistics(model, batch)
    except ConfigError as error:  # the task's own check, naming what is wrong: said as it is
        raise ConfigError(f"{named_option(cfg, 'model')} on {named_option(cfg, 'data')}'s batch: {error}") from None
    except Exception as error:  # noqa: BLE001  reported by the caller, or left to the ranks
        trial.error = error
    finally:
        task.extra_metrics = metrics
    return trial


@contextlib.contextmanager
def _watched(model: torch.nn.Module, trial: _Trial) -> Iterator[None]:
    """Keeps, on `trial`, what the model is called with and returns, and whether an error came from inside it."""

    def before(module: Any, args: tuple, kwargs: dict) -> None:
        trial.model_inputs, trial.model_outputs, trial.in_model = (args, kwargs), None, True

    def after(module: Any, args: tuple, kwargs: dict, outputs: Any) -> None:
        trial.model_outputs, trial.in_model = outputs, False

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _meta_cannot(error: BaseException) -> bool:
    """Whether `error` is the meta device's own limit (an operation it does not implement, a value it does not
    hold: `.item()`, a data-dependent shape), not the model's or the task's refusal of what it was given."""
    text = str(error).lower()
    return isinstance(error, NotImplementedError) or "meta" in text or "doesn't have storage" in text


def _message(cfg: Any, task: Any, trial: _Trial) -> str:
    reason = first_line(trial.error)
    model, data, task_option = named_option(cfg, "model"), named_option(cfg, "data"), named_option(cfg, "task")
    if trial.in_model:
        shape = f"data.input_shape={list(cfg.data.input_shape)}"
        return f"{model} cannot take {data}'s inputs, {_shown(trial.model_inputs)} ({shape}): {reason}"
    if trial.model_outputs is not None:
        targets = ""
        with contextlib.suppress(Exception):  # a task of one's own may read its batch otherwise
            targets = f", against targets {_shown(task.split(trial.batch)[1])}"
        return f"{task_option} cannot take {model}'s outputs, {_shown(trial.model_outputs)}{targets}: {reason}"
    return f"{task_option} with {model} fails on {data}'s batch, {_shown(trial.batch)}: {reason}"


def _shown(value: Any) -> str:
    """The tensors of a model's arguments or outputs, each as dtype [shape] (with its name in a mapping)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):  # (args, kwargs)
        args, kwargs = value
        parts = [_tensor(tensor) for _, tensor in tensors(list(args))]
        parts += [f"{name} {_tensor(tensor)}" for name, item in kwargs.items() for _, tensor in tensors(item)]
        return ", ".join(parts) or "no tensor"
    parts = [
        f"{path.removeprefix('batch')[2:-2]} {_tensor(tensor)}" if path.startswith("batch['") else _tensor(tensor)
        for path, tensor in tensors(value)
    ]
    return ", ".join(parts) or f"a {type(value).__name__}"


def _tensor(tensor: Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def named_option(cfg: Any, group: str) -> str:
    """How the command line names a group's choice (`model=torchvision`), or the `_target_` where the command line
    replaced the option's, or outside a Hydra run (a sweep's jobs, checked before they run)."""
    from hydra.core.hydra_config import HydraConfig

    node = cfg.get(group)
    target_key = f"{group}.dataset._target_" if group == "data" else f"{group}._target_"
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        choice = hydra.runtime.choices.get(group)
        if choice and not any(item.lstrip("+~").startswith(target_key) for item in hydra.overrides.task):
            return f"{group}={choice}"
    return f"{target_key}={OmegaConf.select(cfg, target_key) if node is not None else None}"


def _stand_ins(predictions: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """CPU tensors of the dtypes and per-row shapes of what a validation batch updates the metrics with, with rows
    enough for integer targets to hold every class: a metric built for fewer classes than the outputs have then
    refuses them (MulticlassF1Score(num_classes=5) takes targets below 5 without a word). The classes are the
    outputs' dimension 1 (torchmetrics' (N, C, ...)) or last (a language model's (N, T, vocab)), whichever is
    smaller, where the outputs have one dimension more than the targets; else 2 (binary, multilabel). Values are
    uniform in [0, 1) where real-valued: probabilities, logits and non-negative values alike."""
    generator = torch.Generator().manual_seed(0)
    integer = not targets.is_floating_point() and targets.dtype != torch.bool
    classes = 2
    if predictions.dim() == targets.dim() + 1 and predictions.dim() >= 2:
        classes = max(1, min(predictions.shape[1], predictions.shape[-1]))
    per_row = max(1, targets[:1].numel()) if targets.dim() else 1
    rows = max(len(predictions) if predictions.dim() else 1, -(-classes // per_row) if integer else 0, 2)
    rows = min(rows, 4096)  # a classifier over more classes than this is tried on as many of them

    def values(like: Tensor, high: int) -> Tensor:
        shape = (rows, *like.shape[1:]) if like.dim() else ()
        if like.is_floating_point():
            return torch.rand(shape, generator=generator).to(like.dtype)
        if like.dtype == torch.bool:
            return torch.arange(max(1, int(torch.Size(shape).numel()))).reshape(shape) % 2 == 1
        return (torch.arange(max(1, int(torch.Size(shape).numel()))) % high).reshape(shape).to(like.dtype)

    return values(predictions, classes), values(targets, classes)


@contextlib.contextmanager
def first_call_named(model: torch.nn.Module, name: str) -> Iterator[None]:
    """In a rank, around the loop: an error raised inside the model's first call (what the launcher's trial could not
    try: a model too large to build on the CPU that the meta device cannot run, or one that fails on a batch's size)
    is one line naming the model, what it was given and the line of code that failed, a ConfigError. The hooks go
    with the first call that returns: later calls pay nothing, and their errors are the loop's. Not an error of
    memory, of a collective, or of torch.compile's: those are not the model refusing its inputs. A compiled model
    gets no hooks: torch.compile would trace them (its errors on the first call are its own, as said)."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        yield
        return
    trial = _Trial()
    handles: list[Any] = []

    def before(module: Any, args: tuple, kwargs: dict) -> None:
        trial.model_inputs, trial.in_model = (args, kwargs), True

    def after(module: Any, args: tuple, kwargs: dict, outputs: Any) -> None:
        trial.in_model = False
        for handle in handles:
            handle.remove()

    handles += [
        model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    except (RuntimeError, TypeError, ValueError, IndexError, AssertionError) as error:
        if not trial.in_model or _not_the_inputs(error):
            raise
        raise ConfigError(
            f"{name} cannot take the first batch's inputs, {_shown(trial.model_inputs)}: {first_line(error)} "
            f"({_failed_at(error)})"
        ) from None
    finally:
        for handle in handles:
            handle.remove()


def _failed_at(error: BaseException) -> str:
    """Where: the innermost line of the traceback outside torch itself (the model's code, or its library's)."""
    torch_dir = Path(torch.__file__).parent
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not Path(frame.filename).is_relative_to(torch_dir)
    ]
    frame = frames[-1] if frames else traceback.extract_tb(error.__traceback__)[-1]
    return f"at {frame.filename}:{frame.lineno}, in {frame.name}"


def _not_the_inputs(error: BaseException) -> bool:
    """Errors in a model's call that are not about what it was given."""
    from torch._dynamo.exc import TorchDynamoException

    distributed = getattr(torch.distributed, "DistError", ())
    return isinstance(error, (torch.OutOfMemoryError, TorchDynamoException, ConfigError, distributed))
