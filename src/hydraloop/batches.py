"""Batches of any structure: a tensor, or tuples, lists, dicts, NamedTuples and dataclasses of them, nested.

The loop never looks inside a batch beyond these functions: it moves a batch to the device, counts its rows (the
first dimension, shared by every tensor in it), and cuts it into micro-batches along that dimension. Anything that
is not a tensor (a string, a number) travels through unchanged.
"""

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from hydraloop.errors import ConfigError


def map_tensors(function: Callable[[Tensor], Any], batch: Any) -> Any:
    """`batch` with `function` applied to every tensor in it; the structure, and anything else, as it is."""
    if isinstance(batch, Tensor):
        return function(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple
        return type(batch)(*(map_tensors(function, item) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(function, item) for item in batch)
    if isinstance(batch, Mapping):
        return type(batch)({key: map_tensors(function, value) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {field.name: map_tensors(function, getattr(batch, field.name)) for field in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **changes)
    return batch


def leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """Everything at the ends of `batch`'s structure, with its path (`batch[1]`, `batch['labels']`, `batch.mask`)."""
    if isinstance(batch, (list, tuple)) and any(_is_structure(item) for item in batch):
        for index, item in enumerate(batch):
            yield from leaves(item, f"{path}[{index}]")
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from leaves(getattr(batch, field.name), f"{path}.{field.name}")
    else:  # a tensor, or anything else: a list of strings (what collation makes of strings) is one leaf
        yield path, batch


def _is_structure(item: Any) -> bool:
    return isinstance(item, (Tensor, list, tuple, Mapping)) or dataclasses.is_dataclass(item)


def tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    """Every tensor in `batch` with its path in the structure."""
    return ((where, leaf) for where, leaf in leaves(batch, path) if isinstance(leaf, Tensor))


def check_leaves(batch: Any, where: str) -> None:
    """Every leaf of a collated batch is a tensor, and all agree on the rows: else one line naming the leaf."""
    for path, leaf in leaves(batch):
        if not isinstance(leaf, Tensor):
            raise ConfigError(
                f"{where}: {path} of a batch is a {type(leaf).__name__}; every leaf of a batch must be a tensor "
                "(numbers and arrays in samples are collated into tensors, strings are not: tokenize them in the data "
                "set)"
            )
    try:
        count_rows(batch)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on `device`; asynchronous from pinned host memory."""
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)


def count_rows(batch: Any) -> int:
    """The batch's rows: the first dimension of its tensors, which must agree (checked; one line if they do not)."""
    if isinstance(batch, Tensor) and batch.dim():  # the common cases first: no walk over a structure
        return len(batch)
    if isinstance(batch, tuple) and all(isinstance(item, Tensor) and item.dim() for item in batch):
        sizes = {len(item) for item in batch}
        if len(sizes) == 1:
            return sizes.pop()
    sizes = {len(tensor) for _, tensor in tensors(batch) if tensor.dim()}
    if len(sizes) == 1:
        return sizes.pop()
    if not sizes:
        raise ConfigError("the batch holds no tensor with a batch dimension (rows)")
    shown = ", ".join(f"{path} has {len(tensor)}" for path, tensor in tensors(batch) if tensor.dim())
    raise ConfigError(f"the batch's tensors disagree on its rows (first dimension): {shown}")


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of every tensor of `batch` (views, no copies); 0-d tensors as they are."""
    return map_tensors(lambda tensor: tensor[start:stop] if tensor.dim() else tensor, batch)
