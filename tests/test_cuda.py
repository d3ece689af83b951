"""On a GPU, what tests/test_device_paths.py checks with stand-ins, run for real. Skipped without CUDA.

scripts/gpu_check.sh runs this module. With HYDRALOOP_TEST_DEVICE=cpu it runs on the CPU instead: that is how the
script's dry run (`--device cpu`) gets through every step before a GPU is ever lent.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from conftest import max_param_diff
from hydraloop.parallel.dataparallel import DataParallelStrategy
from hydraloop.precision import Precision

DEVICE = os.environ.get("HYDRALOOP_TEST_DEVICE", "cuda")
GPUS = torch.cuda.device_count() if DEVICE == "cuda" else 0
RANKS = min(GPUS, 2) if DEVICE == "cuda" else 2  # nccl: one GPU per rank

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(DEVICE == "cuda" and not GPUS, reason="needs CUDA (run by scripts/gpu_check.sh)"),
]

# Deterministic kernels: runs that should be equal are compared bit for bit where the maths is the same.
COMMON = (f"device={DEVICE}", "logger=none", "trainer.deterministic=true")
ROUND_OFF = 1e-5


@pytest.fixture(scope="module")
def single(run_train):
    run = run_train(*COMMON, "trainer.max_epochs=2")
    assert run.returncode == 0, run.output
    return run


def test_resume_equals_the_uninterrupted_run(run_train):
    """Dropout draws from the GPU's generator, reseeded per step: the resumed epoch draws what the uninterrupted one
    drew. The checkpoint is read to the CPU (the RNG state included) and copied to the GPU by load_state_dict."""
    recipe = (*COMMON, "model.dropout=0.2")
    first = run_train(*recipe, "trainer.max_epochs=1")
    assert first.returncode == 0, first.output
    resumed = run_train(*recipe, "trainer.max_epochs=2", f"ckpt_path={first.run_dir}/checkpoints/last.pt")
    uninterrupted = run_train(*recipe, "trainer.max_epochs=2")
    assert resumed.returncode == 0 and uninterrupted.returncode == 0, resumed.output + uninterrupted.output
    assert max_param_diff(resumed.checkpoint()["model"], uninterrupted.checkpoint()["model"]) == 0.0
    assert resumed.metrics["val/acc"] == uninterrupted.metrics["val/acc"]


def test_a_gpu_checkpoint_opens_on_a_machine_without_one(single, train_env):
    """Plain torch.load(weights_only=True), as README says, in a process that sees no GPU."""
    probe = (
        "import sys, torch; c = torch.load(sys.argv[1], weights_only=True); "
        "ts = [*c['model'].values(), *(v for s in c['optimizer']['state'].values() for v in s.values())]; "
        "print(sorted({t.device.type for t in ts}), len(ts))"
    )
    env = {**train_env, "CUDA_VISIBLE_DEVICES": ""}
    path = single.run_dir / "checkpoints" / "last.pt"
    proc = subprocess.run([sys.executable, "-c", probe, str(path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    devices, count = proc.stdout.split("] ")
    assert devices == "['cpu'" and int(count) == 6 + 6 * 3  # 3 linear layers' weights and biases; AdamW's 3 each


def test_dataparallel_on_the_visible_gpus_equals_single(run_train, single):
    dp = run_train(*COMMON, "parallel=dataparallel", "trainer.max_epochs=2")
    assert dp.returncode == 0, dp.output
    assert max_param_diff(dp.checkpoint()["model"], single.checkpoint()["model"]) < ROUND_OFF
    assert dp.metrics["val/acc"] == single.metrics["val/acc"]


@pytest.mark.skipif(GPUS < 2, reason="DataParallel splits only over 2 or more GPUs")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_dataparallel_replicas_compute_in_the_configured_dtype(precision):
    strategy = DataParallelStrategy("cuda")
    strategy.setup()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append((output.device.index, output.dtype)))
    wrapped = strategy.wrap(model)
    with Precision(precision, strategy.device).autocast():
        wrapped(torch.randn(4 * GPUS, 8, device=strategy.device))
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert sorted(seen) == [(index, expected) for index in range(GPUS)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_per_gpu_equals_single(run_train, single, parallel):
    run = run_train(*COMMON, f"parallel={parallel}", f"parallel.nproc_per_node={RANKS}", "trainer.max_epochs=2")
    assert run.returncode == 0, run.output
    assert run.metrics["world_size"] == RANKS
    assert max_param_diff(run.checkpoint()["model"], single.checkpoint()["model"]) < ROUND_OFF


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_finite_losses(run_train, precision):
    run = run_train(f"device={DEVICE}", "logger=none", f"trainer.precision={precision}", "trainer.max_epochs=4")
    assert run.returncode == 0, run.output
    assert 0 < run.metrics["train/loss"] < 1 and run.metrics["val/acc"] > 0.9  # float32: ~0.94 after 4 epochs


# The character-level GPT with dropout (KeyedDropout's integer hashing on the GPU) and the fused attention kernels.
TINY_GPT = (
    f"device={DEVICE}",
    "experiment=text_gpt",
    "model.n_layer=2",
    "model.n_embd=64",
    "model.dropout=0.2",
    "trainer.max_steps=20",
    "scheduler.warmup_steps=5",  # the recipe's 40 would pass the run
    "trainer.val_every_n_steps=null",
    "trainer.limit_val_batches=4",
    "logger=none",
)


def test_gpt_with_dropout_under_ddp_equals_single(run_train):
    single = run_train(*TINY_GPT)
    ddp = run_train(*TINY_GPT, "parallel=ddp", f"parallel.nproc_per_node={RANKS}")
    assert single.returncode == 0 and ddp.returncode == 0, single.output + ddp.output
    # The fused attention kernels may sum in another order for another batch size: round-off, not masks.
    assert max_param_diff(ddp.checkpoint()["model"], single.checkpoint()["model"]) < 1e-4


def test_gpt_in_bf16_compiled_learns(run_train):
    run = run_train(*TINY_GPT, "trainer.max_steps=200", "trainer.precision=bf16", "trainer.compile=true", timeout=400)
    assert run.returncode == 0, run.output
    assert run.metrics["val/loss"] < 3.3  # the unigram entropy of the text: it has learnt context


def test_compiled_model_trains_like_the_plain_one(run_train, single):
    compiled = run_train(*COMMON, "trainer.compile=true", "trainer.max_epochs=2", timeout=400)
    assert compiled.returncode == 0, compiled.output
    state = compiled.checkpoint()["model"]
    assert state.keys() == single.checkpoint()["model"].keys()
    # Fused kernels may round differently from the eager ones.
    assert max_param_diff(state, single.checkpoint()["model"]) < 1e-4


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA synchronisations")
def test_no_device_sync_in_the_steady_state_step_on_cuda(train_in_process):
    """On CUDA, torch itself reports every call that waits for the device (set_sync_debug_mode): their number must
    not grow with the number of steps, in fp32 and in bf16."""
    for precision in ("32", "bf16"):
        counts = []
        for steps in (4, 16):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    train_in_process(
                        "device=cuda",
                        f"trainer.precision={precision}",
                        "trainer.max_epochs=2",
                        "logger=none",
                        f"trainer.limit_train_batches={steps}",
                        "trainer.log_every_n_steps=1000",
                    )
            finally:
                torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(warning.message) for warning in caught))
        assert counts[0] == counts[1], (precision, counts)


@pytest.mark.skipif(DEVICE != "cuda", reason="on the CPU, short sequences take the explicit attention")
def test_keyed_attention_dropout_saves_no_attention_weights_on_a_gpu_at_any_length():
    """Where torch's attention with dropout would be fused (a GPU), keyed dropout computes attention a block of
    queries at a time at any length: no (batch, heads, T, T) tensor is saved for the backward pass."""
    pytest.importorskip("transformers", reason="the hf extra")
    from hydraloop.models.hf import hf_model
    from hydraloop.row_keys import RowKeys

    config = {"n_layer": 1, "n_embd": 32, "n_head": 4, "n_positions": 64, "attn_pdrop": 0.1}
    model = hf_model(model_type="gpt2", config=config, vocab_size=50).to(DEVICE).train()
    ids = torch.randint(0, 50, (2, 64), device=DEVICE)
    shapes = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t)
    with hooks, RowKeys(seed=0, rank=0, world_size=1, device=torch.device(DEVICE))(step=1, first_row=0, rows=2):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert (2, 4, 64, 64) not in shapes
