"""`parallel=fsdp`: fully sharded data parallel (FSDP2). DDP's launch and process group, a different wrapper, and
checkpoints that gather the shards into the plain model's and optimizer's state, so that every strategy resumes
from them."""

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.optim import Optimizer

from hydraloop.batches import slice_rows
from hydraloop.errors import ConfigError
from hydraloop.parallel.ddp import DDPStrategy

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
        **process_group: Any,
    ) -> None:
        """`process_group`: how the ranks start, meet and stop, as for DDP (hydraloop.config.ProcessGroupConfig)."""
        super().__init__(device, **process_group)
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
        # would shard onto CUDA.
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def teardown(self) -> None:
        # A gloo worker thread frees a finished collective's work object after Python has its result, taking the GIL
        # to release its tensors; one still waiting for the GIL when the interpreter shuts down aborts the process
        # ("terminate called without an active exception"; a torchrun rank, about 1 run in 10 on a busy 2-core
        # machine). DDP's process group is destroyed in teardown, joining those threads; FSDP's stays alive past
        # destroy_process_group, held by its device mesh, which DTensor's caches keep (torch 2.14). A moment without
        # the GIL lets its threads finish first.
        time.sleep(0.05)
        super().teardown()

    def wrap(self, model: nn.Module, parts: Sequence[str] = ()) -> nn.Module:
        """The model sharded; with several optimizers each part (`parts`) is a root of its own, sharded alike, since a
        task calls the parts, never the whole model; the model holds them unsharded, as a plain container."""
        model = self.with_global_batchnorm(model).to(self.device)
        units = self.units(model)
        for root in [model.get_submodule(part) for part in parts] or [model]:
            self._shard(root, units)
        return model

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

    def reduce_gradients(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        pass  # the backward has reduce-scattered every gradient: each rank holds its shard of the mean

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # unlike DDP, no plain module to fall back on: each rank holds only shards (see eval_batches)

    def eval_batches(self, batches: Iterable[Any], count: int) -> Iterator[Any]:
        """Every forward pass all-gathers, so every rank must run as many as the others. The validation shards
        may differ by one sample, and so by one batch: a rank with fewer batches runs the missing passes on an
        empty batch, which adds nothing to the metrics."""
        counts = torch.zeros(self.world_size, device=self.device)
        counts[self.rank] = count
        counts = self.all_reduce(counts)
        most = int(counts.max())
        if most > 0 and not bool(counts.all()):
            raise ConfigError(f"parallel=fsdp: the validation set has fewer samples than the {self.world_size} ranks")
        batch = None
        for batch in batches:
            yield batch
        for _ in range(most - count):
            yield slice_rows(batch, 0, 0)

    def state_dicts(
        self, model: nn.Module, optimizers: dict[str, Optimizer]
    ) -> Callable[[], tuple[dict, dict[str, dict]]]:
        # Gathering the full tensors is a collective that every rank joins, now; only rank 0 receives them, on
        # the CPU. An optimizer's state comes keyed by parameter name; a checkpoint keys it like a plain
        # optimizer, by position, so that any strategy resumes from it.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        by_name = {name: get_optimizer_state_dict(model, o, options=options) for name, o in optimizers.items()}
        return lambda: (model_state, {name: _keyed_by_position(state) for name, state in by_name.items()})

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        # Every rank read the full state; each keeps its own shard of it.
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
        # The checkpoint keys parameters by position in the optimizer's groups; FSDP's loader wants their names.
        name_of = {param: name for name, param in model.named_parameters()}
        names = [name_of[param] for group in optimizer.param_groups for param in group["params"]]
        set_optimizer_state_dict(
            model, optimizer, _rekeyed(state, names), options=StateDictOptions(full_state_dict=True)
        )


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


def _keyed_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name -> `Optimizer.state_dict()`'s format, keyed by the
    parameter's position in the optimizer's groups (counted across groups)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    return _rekeyed(state, {name: position for position, name in enumerate(names)})


def _rekeyed(state: dict[str, Any], new_key: dict | list) -> dict[str, Any]:
    """An optimizer state with every parameter key (in `state` and in each group's `params`) k -> new_key[k]."""
    return {
        "state": {new_key[k]: value for k, value in state["state"].items()},
        "param_groups": [{**group, "params": [new_key[k] for k in group["params"]]} for group in state["param_groups"]],
    }
