"""parallel=fsdp's model and optimizer state into and out of a checkpoint: each rank writes and reads its own shards
(hydraloop.sharded_checkpoint), or, `parallel.checkpoint=full`, rank 0 gathers one file and hands each rank its
shards of it. Either kind keys an optimizer's state as every strategy reads it, so every strategy resumes from it."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from hydraloop.checkpoint import by_name
from hydraloop.sharded_checkpoint import Shards, WrittenShards, keyed_by_position, rekeyed, write_shards

# Rank 0 holds the full state; each rank receives only its shards of it.
FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def gathered_state_dicts(
    model: nn.Module, optimizers: dict[str, Optimizer]
) -> Callable[[], tuple[Any, dict[str, dict]]]:
    """The model's and each optimizer's full state, as a plain model and optimizer hold it, for rank 0 to write."""
    # Gathering the full tensors is a collective that every rank joins, now; only rank 0 receives them, on
    # the CPU. An optimizer's state comes keyed by parameter name; a checkpoint keys it like a plain
    # optimizer, by position, so that any strategy resumes from it.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    states = {name: get_optimizer_state_dict(model, o, options=options) for name, o in optimizers.items()}
    return lambda: (model_state, {name: keyed_by_position(state) for name, state in states.items()})


def write_own_shards(
    model: nn.Module,
    optimizers: dict[str, Optimizer],
    staging: Path,
    group: dist.ProcessGroup | None,
    background: bool,
) -> tuple[WrittenShards, dict[str, dict]]:
    """This rank's shards of the model and of the optimizers' state written into `staging`, now or in the
    `background` (on `group`, a process group of their own); what the writer (rank 0) gets of the rest: each
    optimizer's param_groups, keyed by parameter name."""
    # The model's first: its state_dict hook reshards parameters a forward left gathered (validation's, with
    # reshard_after_forward=false), which the optimizer's, keyed by the sharded parameters, needs.
    model_state = get_model_state_dict(model)
    states = {name: get_optimizer_state_dict(model, optimizer) for name, optimizer in optimizers.items()}
    tensors = {"model": model_state, "optimizer": by_name({name: state["state"] for name, state in states.items()})}
    future = write_shards(tensors, staging, group, background=background)
    groups = {name: {"param_groups": state["param_groups"]} for name, state in states.items()}
    return WrittenShards(staging, future), groups


def load_model_state(model: nn.Module, state: dict[str, Any] | Shards, rank: int) -> None:
    if isinstance(state, Shards):  # each rank reads its own shards, however many ranks wrote them
        set_model_state_dict(model, state.load_into(get_model_state_dict(model)))
        return
    # Rank 0 reads the full state (every rank opened the file, memory-mapped: what a rank never reads costs it
    # no memory) and sends each rank its shards, one tensor at a time.
    set_model_state_dict(model, _from_rank_0(state, rank), options=FROM_RANK_0)


def load_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any], rank: int) -> None:
    if isinstance(state["state"], Shards):  # keyed by parameter name, as FSDP's loader wants
        template = get_optimizer_state_dict(model, optimizer)  # this rank's shards of every moment
        loaded = {"state": state["state"].load_into(template["state"]), "param_groups": state["param_groups"]}
        set_optimizer_state_dict(model, optimizer, loaded)
        return
    # The checkpoint keys parameters by position in the optimizer's groups; FSDP's loader wants their names.
    name_of = {param: name for name, param in model.named_parameters()}
    names = [name_of[param] for group in optimizer.param_groups for param in group["params"]]
    set_optimizer_state_dict(model, optimizer, _from_rank_0(rekeyed(state, names), rank), options=FROM_RANK_0)


def _from_rank_0(state: dict[str, Any], rank: int) -> dict[str, Any]:
    return state if rank == 0 else {}
