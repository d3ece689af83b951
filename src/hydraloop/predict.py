"""mode=predict: the model of `ckpt_path` over the inputs in `data.predict_path`, written to
<run dir>/predictions.npz in the file's order, under every strategy.

    python src/train.py mode=predict ckpt_path=outputs/DATE/TIME/checkpoints/best.pt data.predict_path=new.npz

The file is a `.npz` or `.pt` holding `x`, shaped `(N, *data.input_shape)`, as `data=tensors` reads it; for a model
of several inputs, a structure of tensors of N rows each (a `.pt`'s `x` as a dict or list; a `.npz`'s arrays
`x.<name>`), which the task passes to the model as a batch's inputs (`Task.predict`). What is written is the
task's, beside a metrics.json that names it: for classification `class` and `probabilities`, for regression
`prediction`, for a language model `next_token`. Each rank predicts every world_size-th input; the ranks' rows are
summed into one array per key (each row written by exactly one rank, zeros elsewhere), which rank 0 saves.
"""

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hydraloop.batches import check_leaves, count_rows, map_tensors, to_device
from hydraloop.data.array_files import read_arrays
from hydraloop.data.samplers import ShardSampler
from hydraloop.errors import ConfigError
from hydraloop.optim import part_modules
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.restore import load_weights
from hydraloop.seeding import seeded_build
from hydraloop.storage import write_atomic
from hydraloop.tasks.base import Task

log = logging.getLogger(__name__)


def load_inputs(path: str, input_shape: list[int], tokens: bool = False) -> Any:
    """The file's inputs, `x`, checked (a misfit is one line, ConfigError): a tensor shaped (N, *input_shape), as
    token ids in int64 for a task that counts tokens (a language model), else float32; or, for a model of several
    inputs, a structure of tensors with N rows each: a dict (a .pt's `x`, or a .npz's `x.<name>` arrays) or a list."""
    where = f"data.predict_path={path}"
    arrays = read_arrays(Path(str(path)), where)
    named = {key.removeprefix("x."): value for key, value in arrays.items() if key.startswith("x.")}
    x = arrays.get("x", named or None)
    if x is None:
        raise ConfigError(f"{where}: no 'x' in the file; it holds {', '.join(sorted(arrays)) or 'nothing'}")
    if not isinstance(x, torch.Tensor):  # several inputs: each row of every tensor is one input's
        check_leaves(x, where)
        return map_tensors(lambda tensor: tensor.float() if tensor.dtype == torch.float64 else tensor, x)
    if x.dim() == 0 or list(x.shape[1:]) != list(input_shape):
        raise ConfigError(
            f"{where}: 'x' samples have shape {list(x.shape[1:])}, but data.input_shape={list(input_shape)}"
        )
    if len(x) == 0:
        raise ConfigError(f"{where}: 'x' holds no samples")
    return x.to(torch.int64 if tokens else torch.float32)


class _Rows(Dataset):
    """Row i of every tensor of `inputs`, with i: the rows of a prediction's inputs, whatever their structure."""

    def __init__(self, inputs: Any) -> None:
        self.inputs, self.count = inputs, count_rows(inputs)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return map_tensors(lambda tensor: tensor[index], self.inputs), index


def predict(cfg: Any, strategy: SingleDevice, task: Task) -> dict[str, Any]:
    inputs = _Rows(load_inputs(cfg.data.predict_path, cfg.data.input_shape, tokens=task.tokens_per_sample is not None))
    if len(inputs) < strategy.world_size:
        raise ConfigError(
            f"data.predict_path={cfg.data.predict_path}: fewer inputs than the {strategy.world_size} ranks"
        )
    model = strategy.build(lambda: seeded_build(cfg.model, cfg.seed))
    model = strategy.wrap(model, part_modules(cfg.optimizer))  # as in training
    precision = Precision(cfg.trainer.precision, strategy.device)
    state = load_weights(cfg.ckpt_path, strategy, model, cfg.ckpt_weights)
    module = strategy.eval_module(model)
    module.eval()
    device, count = strategy.device, len(inputs)
    sampler = ShardSampler(count, strategy.rank, strategy.world_size)
    batch_size = max(1, (cfg.data.val_batch_size or cfg.data.batch_size) // strategy.world_size)
    loader = DataLoader(inputs, batch_size=batch_size, sampler=sampler)
    gathered: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        batches = itertools.islice(loader, None)
        for batch, rows in strategy.eval_batches(batches, len(loader)):
            with precision.autocast():
                predicted = task.predict(module, to_device(batch, device))
            for key, value in predicted.items():
                if key not in gathered:
                    gathered[key] = torch.zeros(count, *value.shape[1:], dtype=value.dtype, device=device)
                gathered[key][rows.to(device)] = value
    arrays = {key: strategy.all_reduce(value).cpu().numpy() for key, value in gathered.items()}
    path = Path(cfg.output_dir) / "predictions.npz"
    summary = {"predictions": str(path), "num_predictions": count, "epoch": state.epoch}
    summary["global_step"] = state.global_step  # of the checkpoint
    if strategy.is_main_process:
        write_atomic(path, lambda file: np.savez(file, **arrays))
        text = json.dumps(summary, indent=2) + "\n"
        write_atomic(path.with_name("metrics.json"), lambda file: file.write(text.encode()))
        log.info("predictions for %d inputs: %s (%s)", count, path, ", ".join(arrays))
    return summary
