"""Sharded checkpoints (parallel=fsdp's default, `parallel.checkpoint=sharded`): `step-00000120.pt` is a directory
that torch.distributed.checkpoint (DCP) writes, each rank its own shards of the model's and optimizers' tensors, and
that any number of ranks reads back, each only what it holds (DCP reshards: 2 ranks' checkpoint resumes on 1 or 4).

Beside the shards, `state.pt` holds everything else a checkpoint holds (hydraloop.checkpoint: the training state,
schedules, generators, config, metrics, callbacks, and each optimizer's param_groups), written by rank 0 once every
rank's shards are on disk. The directory is written as `step-00000120.pt.tmp` and renamed when complete, so a crash
or a killed rank mid-write leaves the previous checkpoints as they were. `last.pt` and `best.pt` are then symbolic
links to it, replaced atomically.

Read back (`read`), a sharded checkpoint is the same dict a single-file one is: in full, for single, ddp, eval and
the scripts; or with `Shards` standing for the tensors, which parallel=fsdp loads into its shards directly.
"""

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hydraloop.errors import ConfigError, StorageError
from hydraloop.storage import describe, fsync_directory, os_error_in, storage_errors

STATE_FILE = "state.pt"


class Shards:
    """Tensors of a sharded checkpoint left on disk: its model's state_dict (`key` ("model",)), or one optimizer's
    state (("optimizer",) or ("optimizer", name)), as DCP saved them."""

    def __init__(self, path: Path, key: tuple[str, ...]) -> None:
        self.path, self.key = Path(path), key

    def load_into(self, template: dict[str, Any], process_group: Any = None) -> dict[str, Any]:
        """`template` (this rank's tensors, DTensor shards or whole ones) filled in place from the files; every rank
        of `process_group` at once, each reading only what its tensors hold."""
        with self._damage():
            dcp.load(_nested(self.key, template), checkpoint_id=self.path, process_group=process_group)
        return template

    def full(self) -> dict[str, Any]:
        """Every tensor under `key`, whole, in this process's memory (on the CPU); no other rank takes part."""
        loaded: dict[str, Any] = {}
        prefix = ".".join(self.key) + "."
        keys = {name for name in _metadata(self.path).state_dict_metadata if name.startswith(prefix)}
        if keys:
            planner = _EmptyStateDictLoadPlanner(keys=keys)
            with self._damage():
                _load_state_dict(loaded, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
        for part in self.key:
            loaded = loaded.get(part, {})
        return loaded

    @contextmanager
    def _damage(self) -> Iterator[None]:
        """A shard whose bytes are damaged (its length intact, which `read` checks) is found only as it is read:
        one line naming the checkpoint, as a damaged file is."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            raise ConfigError(
                f"{self.path}: not a readable checkpoint: its shards cannot be read ({_reason(error)})"
            ) from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor under `key` (a model's: by parameter name), from the metadata alone."""
        prefix = ".".join(self.key) + "."
        return {
            name.removeprefix(prefix): tuple(entry.size)
            for name, entry in _metadata(self.path).state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
        }


class WrittenShards:
    """What a rank hands the checkpoint writer in place of the model's state: its shards are (being) written into
    `staging`; `future`, if the write runs in the background (parallel.async_checkpoint), ends when every rank's are."""

    def __init__(self, staging: Path, future: Future | None) -> None:
        self.staging, self.future = staging, future

    def wait(self, consequence: str) -> None:
        """Until every rank's shards are on disk; a failed write as StorageError (the staging directory removed)."""
        if self.future is None:
            return
        try:
            self.future.result()
        except (Exception, CheckpointException) as error:
            raise _write_error(error, self.staging, consequence) from None
        finally:
            self.future = None


def staging_dir(path: Path) -> Path:
    """Where the checkpoint `path` is written before it is renamed to its name."""
    return path.with_name(path.name + ".tmp")


def write_shards(tensors: dict[str, Any], staging: Path, process_group: Any = None, background: bool = False) -> Any:
    """Every rank's shards of `tensors` into `staging`, on every rank at once: now, or (`background`) from a copy in
    host memory while training goes on (the returned future ends when every rank's shards are on disk)."""
    if background:
        return dcp.async_save(tensors, checkpoint_id=staging, process_group=process_group)
    try:
        dcp.save(tensors, checkpoint_id=staging, process_group=process_group)
    except (Exception, CheckpointException) as error:
        raise _write_error(error, staging, "; the checkpoints saved before are intact") from None
    return None


def _write_error(error: BaseException, staging: Path, consequence: str) -> BaseException:
    """A failed write of shards as StorageError, one line naming the checkpoint and the reason (the operating
    system's, where one is found), with the staging directory removed. DCP reports each failing rank's exception in
    a CheckpointException (a BaseException); torch.save inside it may keep only its own RuntimeError of a write
    the file-size limit cut short. Anything else as it is."""
    shutil.rmtree(staging, ignore_errors=True)
    if not isinstance(error, CheckpointException) and os_error_in(error) is None:
        return error
    return StorageError(f"cannot write {staging.with_suffix('')}: {_reason(error)}{consequence}")


def _reason(error: BaseException) -> str:
    """Why DCP failed, in a few words: the operating system's reason where there is one, else the first failing
    rank's exception (a CheckpointException holds each failing rank's)."""
    failures = {rank: failure for rank, (failure, _) in getattr(error, "failures", {}).items()}
    causes = [cause for cause in map(os_error_in, [*failures.values(), error]) if cause is not None]
    if causes:
        return describe(causes[0])
    rank, failure = next(iter(sorted(failures.items())), (None, error))
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(failure).__name__}: {(str(failure).strip().splitlines() or [''])[0]}"


def finish(state: dict[str, Any], path: Path, consequence: str) -> None:
    """Rank 0, once every rank's shards are in `staging_dir(path)`: the rest of the checkpoint beside them, then the
    directory renamed to `path` (a checkpoint of the same step from an abandoned line of the run goes first)."""
    staging = staging_dir(path)
    rest = {key: value for key, value in state.items() if key != "model"}
    rest["optimizer"] = _without_state(state["optimizer"])
    try:
        with storage_errors(path, consequence):
            with open(staging / STATE_FILE, "wb") as file:
                torch.save(rest, file)
                file.flush()
                os.fsync(file.fileno())
            fsync_directory(staging)
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
            os.replace(staging, path)
            fsync_directory(path.parent)
    except BaseException:  # a failed write, or Ctrl-C's KeyboardInterrupt in it: never a checkpoint, nothing left
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read(path: Path, source: str, lazy: bool) -> dict[str, Any]:
    """A sharded checkpoint as hydraloop.checkpoint.load_checkpoint returns a file's. `lazy`: its tensors as `Shards`
    (read by parallel=fsdp, each rank its own); else whole, in this process's memory. A directory that is not a
    complete one (no metadata, no state.pt, a shard missing or shorter than the metadata says) is refused in one
    line naming what is wrong."""
    _check_complete(path, source)
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ConfigError(f"{source}: {STATE_FILE} is not readable ({type(error).__name__})") from None
    state["model"] = Shards(path, ("model",))
    names = list(state["optimizer"]) if _several(state["optimizer"]) else [""]
    for name in names:
        held = state["optimizer"][name] if name else state["optimizer"]
        held["state"] = Shards(path, ("optimizer", name) if name else ("optimizer",))
    return state if lazy else full(state)


def full(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint read with `Shards` as one with every tensor in memory, in a single file's format."""
    optimizers = state["optimizer"]
    if _several(optimizers):
        optimizer = {name: in_memory(held) for name, held in optimizers.items()}
    else:
        optimizer = in_memory(optimizers)
    return {**state, "model": in_memory(state["model"]), "optimizer": optimizer}


def in_memory(state: Any) -> Any:
    """A checkpoint's model or optimizer state read whole where `Shards` stand for it: the model's state_dict; an
    optimizer's state keyed by position, as Optimizer.state_dict() keys it. Anything else as it is."""
    if isinstance(state, Shards):
        return state.full()
    if isinstance(state, dict) and isinstance(state.get("state"), Shards):
        return keyed_by_position({"state": state["state"].full(), "param_groups": state["param_groups"]})
    return state


def tensor_shapes(model_state: Any) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a checkpoint's `model`, read or left on disk."""
    if isinstance(model_state, Shards):
        return model_state.shapes()
    return {name: tuple(tensor.shape) for name, tensor in model_state.items()}


def keyed_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name -> `Optimizer.state_dict()`'s format, keyed by the
    parameter's position in the optimizer's groups (counted across groups)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    return rekeyed(state, {name: position for position, name in enumerate(names)})


def rekeyed(state: dict[str, Any], new_key: dict | list) -> dict[str, Any]:
    """An optimizer state with every parameter key (in `state` and in each group's `params`) k -> new_key[k]."""
    return {
        "state": {new_key[k]: value for k, value in state["state"].items()},
        "param_groups": [{**group, "params": [new_key[k] for k in group["params"]]} for group in state["param_groups"]],
    }


def _without_state(optimizer: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's `optimizer` with only the param_groups: the state's tensors are in the shards."""
    if _several(optimizer):
        return {name: {"param_groups": held["param_groups"]} for name, held in optimizer.items()}
    return {"param_groups": optimizer["param_groups"]}


def _several(optimizer: dict[str, Any]) -> bool:
    """Whether a checkpoint's `optimizer` holds several optimizers by name (hydraloop.checkpoint.by_name)."""
    return "param_groups" not in optimizer


def _nested(key: tuple[str, ...], value: Any) -> dict[str, Any]:
    for part in reversed(key):
        value = {part: value}
    return value


def _metadata(path: Path) -> Any:
    return FileSystemReader(path).read_metadata()


def _check_complete(path: Path, source: str) -> None:
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{source}: a directory, and not a sharded checkpoint (no .metadata)")
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"{source}: a sharded checkpoint without its {STATE_FILE} (not completely written)")
    try:
        metadata = _metadata(path)
    except Exception as error:
        raise ConfigError(f"{source}: its .metadata is not readable ({type(error).__name__})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise ConfigError(f"{source}: shard {name} is missing")
        if shard.stat().st_size < size:
            raise ConfigError(f"{source}: shard {name} is truncated ({shard.stat().st_size} of {size} bytes)")
