"""The CUDA code paths, checked on a machine without a GPU.

Each test stands in for the GPU with what runs here: the meta device or fake tensors where a tensor must live on a
device that is not the CPU, threads entering autocast as DataParallel's replicas do, and `torch.cuda` patched to
report N GPUs where only the device arithmetic is under test. tests/test_cuda.py runs the real thing on a GPU.
"""

import threading

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import free_port, read_checkpoint
from hydraloop.checkpoint import TrainState, checkpoint_state, load_checkpoint, restore_rng_state, rng_state
from hydraloop.errors import ConfigError
from hydraloop.optim import build_optimizer
from hydraloop.parallel.dataparallel import DataParallelStrategy, autocast_replicas, gpus_to_split_over
from hydraloop.parallel.ddp import DDPStrategy
from hydraloop.parallel.fsdp import FSDPStrategy
from hydraloop.parallel.single import SingleDevice, resolve_device
from hydraloop.perf import interval_peak_memory_gb
from hydraloop.precision import Precision
from hydraloop.restore import restore, train_state
from hydraloop.schedulers import constant
from hydraloop.seeding import StepSeeder


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this process sees n GPUs (torch.cuda's answers only: nothing can run on them)."""

    def see(count: int, visible_devices: str | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if visible_devices is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_devices)

    return see


def test_resume_loads_through_the_cpu_and_keeps_step_counters_there(train_in_process):
    """Resuming onto a device that is not the CPU (here meta, for a GPU): the file is read to the CPU, so the RNG
    state can be restored, and the optimizer's step counters stay on the CPU, as PyTorch keeps them for a non-fused
    optimizer (on the GPU they would cost two host syncs per parameter per step)."""
    _, run_dir = train_in_process("trainer.max_epochs=1", "logger=none")
    path = run_dir / "checkpoints" / "last.pt"
    config = OmegaConf.create(read_checkpoint(path)["config"])
    strategy = SingleDevice("cpu")
    strategy.setup()
    strategy.device = torch.device("meta")
    with torch.device("meta"):
        model = instantiate(config.model)
    optimizer = build_optimizer(config.optimizer, model)
    scheduler = constant(optimizer, total_steps=100, steps_per_epoch=10)
    checkpoint = load_checkpoint(path)
    state = train_state(checkpoint, config, own=True)
    restore(checkpoint, strategy, model, {"": optimizer}, {"": scheduler}, Precision("32", torch.device("cpu")))
    assert state.epoch == 1 and state.global_step == 22
    per_parameter = list(optimizer.state.values())
    assert len(per_parameter) == len(list(model.parameters()))
    assert {entry["step"].device.type for entry in per_parameter} == {"cpu"}
    assert {entry["exp_avg"].device.type for entry in per_parameter} == {"meta"}  # where the parameters are


def test_a_checkpoint_holds_cpu_tensors_whatever_device_trained():
    """Fake CUDA tensors (shapes and devices, no data) stand in for a model and optimizer trained on a GPU."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model_state = {name: torch.empty_like(tensor, device="cuda") for name, tensor in model.state_dict().items()}
        optimizer_state = optimizer.state_dict()
        optimizer_state["state"] = {
            key: {name: torch.empty_like(value, device="cuda") for name, value in entry.items()}
            for key, entry in optimizer_state["state"].items()
        }
        assert {tensor.device.type for tensor in model_state.values()} == {"cuda"}
        saved = checkpoint_state(
            model_state,
            {"": optimizer_state},
            {"": constant(optimizer, total_steps=1, steps_per_epoch=1)},
            Precision("32", torch.device("cpu")),
            TrainState(),
            {},
            {},
            torch.device("cpu"),
        )
    tensors = [
        *saved["model"].values(),
        *(value for entry in saved["optimizer"]["state"].values() for value in entry.values()),
    ]
    assert len(tensors) == 2 + 2 * 3  # weight, bias; step, exp_avg, exp_avg_sq of each
    assert {tensor.device.type for tensor in tensors} == {"cpu"}


def test_cuda_rng_state_is_the_ranks_own_gpus(monkeypatch):
    """Saved by rank 7 of an 8-GPU node, restored on a machine with one GPU: only one GPU's state is involved each
    time, the rank's own."""
    saved_from, restored = [], []

    def get_rng_state(device):
        saved_from.append(device)
        return torch.full((16,), device.index, dtype=torch.uint8)

    def every_gpu(*args):
        raise AssertionError("the state of every visible GPU was asked for")

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    state = rng_state(torch.device("cuda", 7))
    assert saved_from == [torch.device("cuda", 7)]
    restore_rng_state(state, torch.device("cuda", 0))
    assert restored == [(7, torch.device("cuda", 0))]
    restore_rng_state(rng_state(torch.device("cpu")), torch.device("cuda", 0))  # a CPU checkpoint has no GPU state
    assert len(restored) == 1


def test_dataparallel_replicas_compute_in_the_configured_dtype():
    """What torch.nn.parallel.parallel_apply does in each replica's thread (torch 2.13): re-enter autocast without
    a dtype, which gives the thread's default dtype (CUDA's float16; on the CPU, bfloat16). The configured dtype
    here is float16 on the CPU, so the default would show."""
    seen = {}

    def in_a_replica_thread(name, replica):
        def work():
            with torch.amp.autocast("cpu", enabled=True):
                seen[name] = replica(torch.randn(2, 4)).dtype

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    with torch.autocast("cpu", dtype=torch.float16):
        (plain,) = [nn.Linear(4, 4)]
        (wrapped,) = autocast_replicas([nn.Linear(4, 4)], "cpu")
        in_a_replica_thread("plain", plain)
        in_a_replica_thread("wrapped", wrapped)
    assert seen == {"plain": torch.bfloat16, "wrapped": torch.float16}
    assert autocast_replicas([plain], "cpu") == [plain]  # outside autocast: the replicas as they are


def test_dataparallel_refuses_compile_when_it_would_split(gpus):
    cfg = OmegaConf.create({"trainer": {"compile": True}})
    gpus(2)
    with pytest.raises(ConfigError, match=r"^trainer.compile=true: parallel=dataparallel over GPUs \[0, 1\]"):
        DataParallelStrategy("auto").check(cfg)
    DataParallelStrategy("auto", device_ids=[1]).check(cfg)  # one GPU: trains like single, which compiles
    gpus(1)
    DataParallelStrategy("auto").check(cfg)


@pytest.mark.parametrize(
    ("device", "device_ids", "visible", "expected"),
    [
        ("cuda", None, 4, [0, 1, 2, 3]),
        ("cuda:1", None, 4, [1, 0, 2, 3]),  # the model's GPU first: DataParallel gathers there
        ("auto", [2, 3], 4, [2, 3]),
        ("cuda:2", [2, 3], 4, [2, 3]),
        ("cpu", None, 4, []),
    ],
)
def test_dataparallel_gpus(gpus, device, device_ids, visible, expected):
    gpus(visible)
    assert gpus_to_split_over(device, device_ids) == expected


@pytest.mark.parametrize(
    ("device", "device_ids", "message"),
    [
        ("cuda:1", [2, 3], "device=cuda:1: DataParallel gathers on the first of parallel.device_ids=[2, 3]"),
        ("cuda", [0, 0], "parallel.device_ids=[0, 0]: must be distinct GPU indices below 4"),
        ("cuda", [1, 4], "parallel.device_ids=[1, 4]: must be distinct GPU indices below 4"),
    ],
)
def test_dataparallel_gpus_that_cannot_work(gpus, device, device_ids, message):
    gpus(4)
    with pytest.raises(ConfigError) as error:
        gpus_to_split_over(device, device_ids)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("device", "local_rank", "visible", "visible_devices", "expected"),
    [
        ("auto", 0, 0, None, "cpu"),
        ("auto", 1, 2, None, "cuda:1"),
        ("cuda", 3, 4, "0,1,2,3", "cuda:3"),
        ("cuda", 3, 1, "3", "cuda:0"),  # SLURM --gpus-per-task / torchrun with a GPU bound to each task
        ("cuda:1", 0, 2, None, "cuda:1"),
        ("cpu", 2, 4, None, "cpu"),
    ],
)
def test_each_rank_gets_its_gpu(gpus, device, local_rank, visible, visible_devices, expected):
    gpus(visible, visible_devices)
    assert resolve_device(device, local_rank) == torch.device(expected)


@pytest.mark.parametrize(
    ("device", "local_rank", "visible", "message"),
    [
        ("cuda", 1, 1, "device=cuda: this rank (LOCAL_RANK=1) has no GPU of its own, only 1 GPU(s) visible"),
        ("cuda", 2, 2, "device=cuda: this rank (LOCAL_RANK=2) has no GPU of its own, only 2 GPU(s) visible"),
        ("cuda:2", 0, 2, "device=cuda:2: only 2 GPU(s) visible"),
        ("cuda", 0, 0, "device=cuda: CUDA is not available on this machine"),
    ],
)
def test_a_rank_without_a_gpu_of_its_own_is_refused(gpus, device, local_rank, visible, message):
    gpus(visible)  # no CUDA_VISIBLE_DEVICES: every rank sees the same GPUs
    with pytest.raises(ConfigError) as error:
        resolve_device(device, local_rank)
    assert str(error.value).startswith(message)


def test_ddp_with_one_named_gpu_for_several_ranks_is_refused(gpus, monkeypatch):
    gpus(2)
    with pytest.raises(ConfigError, match=r"^device=cuda:1: names one GPU for the 2 ranks on this machine"):
        DDPStrategy("cuda:1", nproc_per_node=2)
    assert DDPStrategy("cuda:1", nproc_per_node=1).world_size == 1
    # Under torchrun: the same for two ranks on this node, unless each sees its own GPU only.
    for key, value in dict(
        RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="n0", MASTER_PORT=29500
    ).items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(ConfigError, match=r"^device=cuda:1: names one GPU for the 2 ranks on this machine"):
        DDPStrategy("cuda:1")
    gpus(1, visible_devices="5")
    assert DDPStrategy("cuda:0").local_rank == 1


def test_fsdp_shards_on_its_own_device_type(monkeypatch):
    """On a machine with a GPU, fully_shard without a mesh builds one on the default accelerator: stand in for that
    machine by making CUDA the default accelerator, and shard with device=cpu."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    strategy = FSDPStrategy("cpu")
    strategy.setup()
    try:
        model = strategy.wrap(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        meshes = {param.device_mesh.device_type for param in model.parameters()}
        assert meshes == {"cpu"}
        assert model(torch.randn(3, 4)).shape == (3, 2)
    finally:
        strategy.teardown()
    assert not dist.is_initialized()


def test_each_gpu_of_the_rank_is_reseeded_before_every_step(monkeypatch):
    """Under DataParallel a rank computes on several GPUs, each replica drawing dropout from its own GPU's generator."""
    generators = tuple(torch.Generator() for _ in range(3))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    seed_step = StepSeeder(0, 0, [torch.device("cuda", 0), torch.device("cuda", 2)])
    seed_step(5)
    expected = seed_step.base + 5
    assert [generator.initial_seed() for generator in generators] == [expected, generators[1].initial_seed(), expected]
    assert generators[1].initial_seed() != expected
    assert torch.default_generator.initial_seed() == expected


def test_peak_memory_is_the_intervals_on_the_ranks_own_gpus(monkeypatch):
    allocated_peak = {0: 5e9, 1: 3e9, 2: 1e9}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated_peak[device.index])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: allocated_peak.update({device.index: 0}))
    assert interval_peak_memory_gb([torch.device("cuda", 1)]) == 3.0  # not GPU 0's
    assert interval_peak_memory_gb([torch.device("cuda", 1), torch.device("cuda", 2)]) == 1.0  # since the last call
    assert allocated_peak == {0: 5e9, 1: 0, 2: 0}
