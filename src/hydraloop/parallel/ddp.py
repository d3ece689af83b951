"""`parallel=ddp`: DistributedDataParallel, one process per device: the settings checked in the launcher, the process
group each rank joins, the wrapper and the reductions. Starting the ranks without torchrun is
hydraloop.parallel.spawned_ranks's."""

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from hydraloop.errors import ConfigError, WorkerFailed, first_line
from hydraloop.parallel.single import SingleDevice, resolve_device
from hydraloop.parallel.spawned_ranks import START_METHODS, forkable, launch_ranks
from hydraloop.sync_batchnorm import convert_sync_batchnorm

T = TypeVar("T")
log = logging.getLogger(__name__)

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class DDPStrategy(SingleDevice):
    """DistributedDataParallel, one process per device.

    If an outside launcher (torchrun, SLURM) already set RANK / WORLD_SIZE / LOCAL_RANK, this process is one rank
    and joins that group. Otherwise `launch` starts `nproc_per_node` ranks itself through
    torch.distributed.elastic, the engine behind torchrun: a c10d rendezvous on a free port (so two jobs on one
    machine never collide), and the whole job is stopped as soon as any rank fails (or, with `max_restarts`,
    restarted: the ranks continue from the run's last checkpoint). A stop signal to the launcher is passed on to
    the ranks, which checkpoint and stop, or finish the run past its last step (see hydraloop.preemption).
    """

    def __init__(
        self,
        device: str = "auto",
        nproc_per_node: int | None = None,
        backend: str | None = None,
        timeout_s: float = 300.0,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        max_restarts: int = 0,
        shutdown_timeout_s: float = 60.0,
        sync_batchnorm: bool = False,
        start_method: str = "auto",
    ) -> None:
        super().__init__(device)
        self.sync_batchnorm = sync_batchnorm
        use_cuda = resolve_device(device).type == "cuda"  # checked by SingleDevice too; needed for defaults
        self.backend = backend or ("nccl" if use_cuda else "gloo")
        self.timeout = timedelta(seconds=timeout_s)
        self.ddp_options = dict(
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        if max_restarts < 0:
            raise ConfigError(f"parallel.max_restarts={max_restarts}: must be 0 or more")
        for key, seconds in (("timeout_s", timeout_s), ("shutdown_timeout_s", shutdown_timeout_s)):
            if not seconds > 0:
                raise ConfigError(f"parallel.{key}={seconds}: must be a positive number of seconds")
        if self.backend == "nccl" and not use_cuda:  # named before the process count it would otherwise fail on
            where = f"device={device}" if torch.cuda.is_available() else "no GPU is visible"
            raise ConfigError(
                f"parallel.backend=nccl: NCCL reduces CUDA tensors, and this run computes on the CPU ({where}); "
                "parallel.backend=gloo reduces CPU tensors (null picks it on the CPU)"
            )
        if start_method not in START_METHODS:
            raise ConfigError(f"parallel.start_method={start_method}: must be one of {', '.join(START_METHODS)}")
        if start_method == "fork" and use_cuda:
            raise ConfigError(
                f"parallel.start_method=fork with device={device}: CUDA cannot be used in a forked process; "
                "spawn (or auto) starts the ranks afresh"
            )
        self.max_restarts = max_restarts
        self.shutdown_timeout_s = shutdown_timeout_s
        self.start_method = start_method
        given = [key for key in LAUNCHER_ENV if key in os.environ]
        self.launched_outside = len(given) == len(LAUNCHER_ENV)
        if given and not self.launched_outside:
            missing = [key for key in LAUNCHER_ENV if key not in os.environ]
            shown = ", ".join(f"{key}={os.environ[key]}" for key in given)
            raise ConfigError(
                f"{shown}: set without {' and '.join(missing)}; a launcher (torchrun, SLURM) sets all of "
                f"{', '.join(LAUNCHER_ENV)} for each rank it starts. Unset {' and '.join(given)} to have this "
                "process start its own ranks"
            )
        if self.launched_outside:
            self.rank, self.local_rank, self.world_size = (
                _env_int(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
            )
            if "MASTER_PORT" in os.environ and not 0 < _env_int("MASTER_PORT") < 65536:
                raise ConfigError(f"MASTER_PORT={os.environ['MASTER_PORT']}: must be a port, from 1 to 65535")
            missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
            if missing and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:  # env://: the ranks meet at rank 0
                raise ConfigError(
                    f"{' and '.join(missing)} not set, beside RANK={self.rank} and WORLD_SIZE={self.world_size}: "
                    "the ranks meet at rank 0's MASTER_ADDR and MASTER_PORT (torchrun and SLURM's launcher set both)"
                )
            if not 0 <= self.rank < self.world_size:
                raise ConfigError(f"RANK={self.rank}: must be in [0, WORLD_SIZE={self.world_size})")
            _check_one_gpu_per_rank(device, _env_int("LOCAL_WORLD_SIZE", 1))
            return
        self.nproc_per_node = (
            nproc_per_node if nproc_per_node is not None else (torch.cuda.device_count() if use_cuda else 2)
        )
        if self.nproc_per_node < 1:
            raise ConfigError(f"parallel.nproc_per_node={nproc_per_node}: must be at least 1")
        if self.backend == "nccl" and self.nproc_per_node > torch.cuda.device_count():
            raise ConfigError(
                f"parallel.nproc_per_node={self.nproc_per_node}: only {torch.cuda.device_count()} GPU(s) visible, "
                "and parallel.backend=nccl needs one GPU per process"
            )
        _check_one_gpu_per_rank(device, self.nproc_per_node)
        self.world_size = self.nproc_per_node

    def launch(self, worker: Callable[..., T], *args) -> T:
        if self.launched_outside:
            return worker(*args)
        start_method = self.start_method
        if start_method != "spawn" and resolve_device(self.device_name).type == "cpu":
            unsafe = forkable()
            if unsafe and start_method == "fork":
                log.warning("parallel.start_method=fork: the ranks are spawned instead, as %s", unsafe)
            start_method = "spawn" if unsafe else "fork"
        else:
            start_method = "spawn"
        return launch_ranks(
            self.nproc_per_node, self.max_restarts, self.shutdown_timeout_s, start_method, worker, *args
        )

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads is not None and not _positive_int(threads):
            log.warning(
                "OMP_NUM_THREADS=%s: not a number of threads; ignored: each rank computes with its share of the cores",
                threads,
            )

    def setup(self) -> None:
        super().setup()
        if self.device.type == "cpu" and not _positive_int(os.environ.get("OMP_NUM_THREADS", "")):
            # Ranks share the cores this process may use (its affinity: a parallel sweep's share, a taskset);
            # without this each would start one thread per core.
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // local_world_size))
        store = _attempt_store(self.timeout)
        try:
            if store is None and self.rank > 0:
                _wait_for_rank_zero(self.timeout.total_seconds())
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=self.timeout,
                device_id=self.device if self.device.type == "cuda" else None,
            )
        except (dist.DistError, TimeoutError) as error:  # a store that never answers, peers that never come
            where = ":".join(os.environ.get(key, "?") for key in ("MASTER_ADDR", "MASTER_PORT"))
            raise WorkerFailed(
                f"rank {self.rank} of {self.world_size}: the process group did not form at {where} within "
                f"parallel.timeout_s={self.timeout.total_seconds():g} ({first_line(error)}); start every rank, with "
                "the same MASTER_ADDR and MASTER_PORT"
            ) from None

    def wrap(self, model: nn.Module, parts: Sequence[str] = ()) -> nn.Module:
        model = super().wrap(self.with_global_batchnorm(model))
        if parts:
            # Several optimizers, each pass stepping one part: a DDP wrapper would wait in every backward for the
            # gradients of parameters that pass leaves alone. The loop reduces the stepped part's instead
            # (reduce_gradients), once per pass, without overlapping the backward. Every rank starts from rank 0's
            # weights, as DDP's constructor would make it.
            for tensor in (*model.parameters(), *model.buffers()):
                dist.broadcast(tensor.detach(), src=0)
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_options)

    def with_global_batchnorm(self, model: nn.Module) -> nn.Module:
        """parallel.sync_batchnorm=true: batch norm over the global batch (hydraloop.sync_batchnorm)."""
        return convert_sync_batchnorm(model, self.device) if self.sync_batchnorm else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()

    def reduce_gradients(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        if isinstance(model, DistributedDataParallel):
            return  # its backward hooks have averaged every gradient
        grads = [param.grad for param in params if param.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def eval_module(self, model: nn.Module) -> nn.Module:
        # DDP's forward can broadcast buffers, a collective that would deadlock when shards differ in length.
        return self.unwrap(model)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return gathered

    def replica_groups(self) -> list[list[int]]:
        return [list(range(self.world_size))]  # every rank holds the whole model, stepped alike

    def sync_buffers(self, model: nn.Module) -> None:
        # DDP broadcasts rank 0's buffers at the next training forward; validation and the checkpoint come first.
        for buffer in self.unwrap(model).buffers():
            dist.broadcast(buffer, src=0)

    def teardown(self) -> None:
        # A gloo worker thread frees a finished collective's work object after Python has its result, taking the GIL
        # to release its tensors; one still waiting for the GIL when the interpreter shuts down aborts the process
        # ("terminate called without an active exception"; a torchrun rank, about 1 run in 10 on a busy 2-core
        # machine under fsdp, whose group its device mesh keeps alive past destroy_process_group; seen once under
        # ddp too, in a whole suite on 2 cores). A moment without the GIL lets those threads finish first.
        time.sleep(0.05)
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_rank_zero(timeout_s: float) -> None:
    """Waits until rank 0's store (MASTER_ADDR:MASTER_PORT) accepts a connection, or raises TimeoutError. torch's
    own client would print a C++ stack per attempt before its Python error."""
    address, port = os.environ.get("MASTER_ADDR", "localhost"), _env_int("MASTER_PORT", 29500)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {address}:{port}: {error.strerror or error}") from None
            time.sleep(0.2)


def _env_int(key: str, default: int | None = None) -> int:
    """An environment variable a launcher sets, as the number it must be; one line naming it if it is not."""
    value = os.environ.get(key)
    if value is None and default is not None:
        return default
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(f"{key}={value}: must be an integer (a launcher's setting: torchrun, SLURM)") from None


def _positive_int(text: str) -> bool:
    return text.strip().isdigit() and int(text) > 0


def _check_one_gpu_per_rank(device: str, local_ranks: int) -> None:
    """`device=cuda:N` names one GPU; with several ranks on this machine each would take it (nccl then fails with a
    duplicate-GPU error), unless the launcher gave each rank a GPU of its own to see (CUDA_VISIBLE_DEVICES per task),
    where cuda:0 is that one."""
    if local_ranks < 2 or not device.startswith("cuda:"):
        return
    if torch.cuda.device_count() == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return
    raise ConfigError(
        f"device={device}: names one GPU for the {local_ranks} ranks on this machine, which each need their own; use "
        "device=cuda (rank i takes GPU i), and CUDA_VISIBLE_DEVICES to choose which GPUs"
    )


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torch.distributed.elastic (torchrun, or `launch` above), the agent's key-value store with a namespace
    per attempt; None elsewhere (init_process_group then reads MASTER_ADDR / MASTER_PORT itself).

    The agent keeps one store across worker restarts, and without the namespace a restarted gloo rank reads the
    dead attempt's addresses and fails to connect: plain `torchrun --max-restarts` with gloo never recovers
    (PyTorch 2.13; pytorch/pytorch#135712 and #167288 report the same for nccl).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hydraloop/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
