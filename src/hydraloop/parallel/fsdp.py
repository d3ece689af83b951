"""`parallel=fsdp`: fully sharded data parallel (FSDP2). DDP's launch and process group, a different wrapper, a model
that no device holds whole (built on the meta device, each rank allocating its own shards), and checkpoints in which
each rank writes and reads its own shards, or one file that rank 0 gathers (hydraloop.parallel.fsdp_state)."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.optim import Optimizer

from hydraloop.errors import ConfigError
from hydraloop.parallel.ddp import DDPStrategy
from hydraloop.parallel.fsdp_state import (
    FROM_RANK_0,
    gathered_state_dicts,
    load_model_state,
    load_optimizer_state,
    write_own_shards,
)
from hydraloop.parallel.shard_draws import whole_tensor_draws
from hydraloop.sharded_checkpoint import Shards, WrittenShards

DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}


class FSDPStrategy(DDPStrategy):
    """Fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`), one process per device.

    Each rank keeps 1/N of every parameter, gradient and optimizer state. Every module whose class name is in
    `shard_modules` is one FSDP unit: its parameters are all-gathered just before its forward (and backward) and
    freed after; the root unit holds the parameters no unit below it took. Gradients are reduce-scattered, so the
    optimizer steps on its shard only. Launching, the process group and metric reductions are DDP's.
    """

    def __init__(
        self,
        device: str = "auto",
        shard_modules: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        build_on_meta: bool = True,
        replicate: int = 1,
        checkpoint: str = "sharded",
        async_checkpoint: bool = False,
        **process_group: Any,
    ) -> None:
        """`process_group`: how the ranks start, meet and stop, as for DDP (hydraloop.config.ProcessGroupConfig);
        the other arguments: hydraloop.config.FSDPConfig."""
        super().__init__(device, **process_group)
        if not (isinstance(replicate, int) and replicate >= 1 and self.world_size % replicate == 0):
            raise ConfigError(
                f"parallel.replicate={replicate}: must divide the world size, {self.world_size} ranks, into groups "
                "of equal size (1: no replication)"
            )
        if checkpoint not in ("sharded", "full"):
            raise ConfigError(f"parallel.checkpoint={checkpoint}: must be sharded or full")
        if async_checkpoint and checkpoint != "sharded":
            raise ConfigError("parallel.async_checkpoint=true: needs parallel.checkpoint=sharded")
        self.replicate = replicate
        self.build_on_meta = build_on_meta
        self.sharded_checkpoints = checkpoint == "sharded"
        self.async_checkpoint = async_checkpoint
        self.in_flight: WrittenShards | None = None  # the checkpoint whose shards are being written
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = MixedPrecisionPolicy(
            param_dtype=_dtype("param_dtype", param_dtype), reduce_dtype=_dtype("reduce_dtype", reduce_dtype)
        )

    def check(self, cfg: Any) -> None:
        """Every name in `shard_modules` must match a module of the model, built on the meta device: shapes only,
        so a typo fails in the launcher, before any rank starts."""
        super().check(cfg)
        with torch.device("meta"):
            model = instantiate(cfg.model)
        found = {type(module).__name__ for module in model.modules()}
        unmatched = [name for name in self.units(model) if name not in found]
        if unmatched:
            raise ConfigError(
                f"parallel.shard_modules={self.shard_modules}: {', '.join(unmatched)} matches no module of "
                f"{type(model).__name__} (it has {', '.join(sorted(found))})"
            )

    def units(self, model: nn.Module) -> list[str]:
        """The class names whose modules become units: `shard_modules`, or by default the model's own
        `_no_split_modules` (Hugging Face's name for the blocks that must stay whole; hydraloop's GPT: Block), else
        every Linear."""
        if self.shard_modules is not None:
            return self.shard_modules
        return list(getattr(model, "_no_split_modules", None) or ["Linear"])

    def setup(self) -> None:
        super().setup()
        # Without a mesh fully_shard builds one on the machine's default accelerator: on a GPU machine, device=cpu
        # would shard onto CUDA. A 2-D mesh makes fully_shard hybrid: it replicates across the first dimension (each
        # group of ranks along it holds one sharded copy) and shards along the second.
        if self.replicate == 1:
            self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        else:
            shape = (self.replicate, self.world_size // self.replicate)
            self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))
        # A background checkpoint write runs its collectives in another thread than training's: on a process group
        # of its own, so that the two never interleave on one (gloo: on the CPU, where async_save stages the shards).
        self.checkpoint_group = dist.new_group(backend="gloo") if self.async_checkpoint else None

    def teardown(self) -> None:
        with suppress(Exception):  # a run ending on an error: its checkpoint in flight still completes or fails
            self.wait_for_checkpoint()
        super().teardown()

    def build(self, make_model: Callable[[], nn.Module]) -> nn.Module:
        """Rank 0 builds the model in full, on the CPU, as single-process training does (its initialisation draws the
        same values; pretrained weights are read once); every other rank on the meta device, which holds shapes and
        no values (`build_on_meta`). `wrap` gives every rank its shards of rank 0's values."""
        if self.rank == 0 or not self.build_on_meta:
            return make_model()
        with torch.device("meta"):
            return make_model()

    def wrap(self, model: nn.Module, parts: Sequence[str] = ()) -> nn.Module:
        """The model sharded; with several optimizers each part (`parts`) is a root of its own, sharded alike, since a
        task calls the parts, never the whole model; the model holds them unsharded, as a plain container.

        With `build_on_meta`, rank 0 keeps its model's values on the CPU and every rank shards a meta model, then
        allocates only its own shards on its device and receives them from rank 0, one tensor at a time: no device
        holds the whole model, and every rank starts from rank 0's values, which are single-process training's."""
        model = self.with_global_batchnorm(model)
        if not self.build_on_meta:
            model = model.to(self.device)
        else:
            initial = _values(model) if self.rank == 0 else None
            _to_meta(model)
        units = self.units(model)
        for root in [model.get_submodule(part) for part in parts] or [model]:
            self._shard(root, units)
        if self.build_on_meta:
            model.to_empty(device=self.device)
            self._receive(model, initial)
        return model

    def _receive(self, model: nn.Module, initial: tuple[dict, dict] | None) -> None:
        """Every rank's shards, and its copy of the buffers, from rank 0's `initial` (state_dict, and the buffers a
        state_dict leaves out: `persistent=False`, which a model computes in its constructor)."""
        state, unsaved = initial or ({}, {})
        set_model_state_dict(model, state, options=FROM_RANK_0)
        saved = set(model.state_dict())
        for name, buffer in model.named_buffers():
            if name not in saved:
                if initial is not None:
                    buffer.copy_(unsaved[name])
                dist.broadcast(buffer, src=0)

    def _shard(self, root: nn.Module, units: list[str]) -> None:
        options = dict(reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy, mesh=self.mesh)
        # fully_shard goes bottom-up (a unit takes the parameters no unit below it took); reversed pre-order
        # visits every module after all of its descendants.
        for module in reversed(list(root.modules())):
            if module is not root and type(module).__name__ in units:
                fully_shard(module, **options)
        fully_shard(root, **options)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # FSDP2's counterpart of DDP's no_sync: gradients accumulate unsharded, without a reduce-scatter.
        roots = [model] if isinstance(model, FSDPModule) else _roots(model)
        for root in roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)

    def replica_groups(self) -> list[list[int]]:
        """Plain FSDP: each rank holds shards of its own, copied nowhere. HSDP (`replicate`): the ranks at the same
        place of each replicate group hold the same shards, a column of the (replicate, shard) mesh."""
        return self.mesh.mesh.reshape(self.replicate, -1).t().tolist()

    def reduce_gradients(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        pass  # the backward has reduce-scattered every gradient: each rank holds its shard of the mean

    def whole_tensor_draws(self) -> AbstractContextManager:
        return whole_tensor_draws()  # a rank's shard draws its slice of the whole tensor's draws

    def reshard(self, model: nn.Module) -> None:
        # Under reshard_after_forward=false a forward leaves each unit's gathered parameters registered in its
        # modules, and the next forward reads them, not the shards, until a backward frees them; validation has no
        # backward. Values written into the shards would not be computed with (and a second write would leave the
        # first's values gathered). Freed, the next forward gathers the shards anew; load_state_dict does the same
        # through FSDP's pre-hook. FSDPModule.reshard is not recursive: each unit is called.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # unlike DDP, no plain module to fall back on: each rank holds only shards (see eval_batches)

    def eval_batches(self, batches: Iterable[Any], count: int) -> Iterator[Any]:
        return self.batches_on_every_rank(batches, count)  # every forward pass all-gathers: all ranks run as many

    def state_dicts(
        self, model: nn.Module, optimizers: dict[str, Optimizer], staging: Path | None = None
    ) -> Callable[[], tuple[Any, dict[str, dict]]]:
        if not self.sharded_checkpoints:
            return gathered_state_dicts(model, optimizers)
        # Each rank writes its own shards, now or in the background (`async_checkpoint`: the next checkpoint, a stop
        # and the end of the run wait for it). The writer (rank 0) gets the rest, and where the shards are.
        self.wait_for_checkpoint()
        written, groups = write_own_shards(model, optimizers, staging, self.checkpoint_group, self.async_checkpoint)
        self.in_flight = written
        return lambda: (written, groups)

    def wait_for_checkpoint(self) -> None:
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            in_flight.wait("; the checkpoints saved before are intact")

    def load_model_state(self, model: nn.Module, state: dict[str, Any] | Shards) -> None:
        load_model_state(model, state, self.rank)

    def load_optimizer_state(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        load_optimizer_state(model, optimizer, state, self.rank)


def _values(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's state_dict, and its buffers that the state_dict leaves out, as tensors that keep the values once
    the model's own tensors are replaced (`_to_meta`)."""
    state = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()}
    return state, {name: buffer.detach() for name, buffer in model.named_buffers() if name not in state}


def _to_meta(model: nn.Module) -> None:
    """Every parameter and buffer of `model` on the meta device, in place. Swapping the tensors' contents keeps each
    Parameter object, so parameters that modules share (tied embeddings) stay one; `Module.to` would make two."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def _roots(model: nn.Module) -> list[FSDPModule]:
    """The sharded parts of a model that several optimizers train (see `wrap`): the FSDP modules outermost."""
    roots: dict[str, FSDPModule] = {}
    for name, module in model.named_modules():  # pre-order: a part comes before its units
        if isinstance(module, FSDPModule) and not any(name.startswith(f"{root}.") for root in roots):
            roots[name] = module
    return list(roots.values())


def _dtype(key: str, name: str | None) -> torch.dtype | None:
    if name not in DTYPES:
        raise ConfigError(f"parallel.{key}={name}: must be null, float32 or bfloat16")
    return DTYPES[name]
