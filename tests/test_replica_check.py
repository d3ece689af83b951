"""trainer.replica_check_every_n_steps: the ranks' copies of the trained state compared bit for bit
(hydraloop.replica_check). Every ddp test runs with the check at its default, and passes it."""

import math
from types import SimpleNamespace

import pytest
import torch

from hydraloop import replica_check
from hydraloop.callbacks import Callback
from hydraloop.parallel.single import SingleDevice
from hydraloop.replica_check import digest, tensor_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_digest_tells_one_ulp_and_an_exchange_of_two_elements(dtype, monkeypatch):
    values = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    nudged, exchanged = values.clone(), values.clone()
    nudged[3, 4] = torch.nextafter(values[3, 4], torch.tensor(math.inf, dtype=dtype))
    exchanged[0, 0], exchanged[0, 1] = values[0, 1], values[0, 0]
    digest = tensor_digest(values).item()
    assert tensor_digest(values.clone()).item() == digest
    assert tensor_digest(nudged).item() != digest
    assert tensor_digest(exchanged).item() != digest
    monkeypatch.setattr(replica_check, "CHUNK", 3)  # a large tensor, digested a chunk at a time: the same digest
    assert tensor_digest(values).item() == digest


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "value", "first_difference"),
    [
        (["parallel=ddp"], "model", "model.net.1.weight"),
        (["parallel=fsdp", "parallel.replicate=2"], "optimizer", "optimizer.state[net.1.weight].exp_avg"),
    ],
    ids=["ddp", "hsdp"],
)
def test_replicas_one_ulp_apart_end_the_run_before_their_checkpoint(run_train, parallel, value, first_difference):
    """Rank 1 alone moves one value by one ulp after the last step (tests.faults.NudgeOnOneRank): the check before
    the end's checkpoint names it, the step and the ranks; last.pt keeps step 3, where the replicas agreed."""
    run = run_train(
        *parallel,
        "trainer.max_steps=6",
        "trainer.ckpt_every_n_steps=3",
        "callbacks=[ema]",  # its averages are compared too, and agree: the first difference is the nudged value
        "+callbacks.nudge._target_=tests.faults.NudgeOnOneRank",
        "+callbacks.nudge.at_step=6",
        f"+callbacks.nudge.value={value}",
        "logger=none",
        timeout=150,
    )
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.output
    errors = [line for line in run.output.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, run.output
    assert (
        f"the replicas diverged by step 6 (they agreed at step 3): {first_difference} on rank 1 differs from rank 0's"
    ) in errors[0]
    assert errors[0].endswith("checkpoints/last.pt holds step 3, where a rerun continues")
    assert sorted(path.name for path in (run.run_dir / "checkpoints").iterdir()) == ["last.pt", "step-00000003.pt"]
    assert run.checkpoint()["global_step"] == 3
    assert not (run.run_dir / "metrics.json").exists()


class SeenNames(Callback):
    """State that is the same on every rank: a set of strings (its iteration order is the process's string hash's,
    which differs between processes unless PYTHONHASHSEED is set). It saves and resumes under single."""

    def state_dict(self, trainer):
        return {"seen": {"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}}

    def load_state_dict(self, trainer, state):
        pass


@pytest.mark.slow
def test_a_set_in_a_callbacks_state_is_no_replica_difference(run_train):
    run = run_train(
        "parallel=ddp",
        "parallel.nproc_per_node=2",
        "trainer.max_steps=4",
        "logger=none",
        "+callbacks.seen._target_=tests.test_replica_check.SeenNames",
        timeout=150,
    )
    # It stopped this run: a set's printed order is its process's string hashes'.
    assert run.returncode == 0, run.output


def test_optimizer_state_held_in_a_list_is_compared_by_value():
    """A state held in a list (LBFGS's history, the preconditioners of Shampoo- and SOAP-style optimizers) is one
    entry per tensor, digested by value: its printed form shows 4 decimals and elides all but the corners of a
    tensor over 1000 elements, which missed a rank's change of 1.0 in the middle."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = [torch.zeros(2000), torch.randn(5, generator=torch.Generator().manual_seed(0))]
    optimizer.state[model.weight]["history"] = history
    trainer = SimpleNamespace(strategy=SingleDevice("cpu"), model=model, optimizers={"": optimizer}, callbacks={})
    entries = dict(replica_check.replicated_state(trainer))
    assert entries["optimizer.state[weight].history[0]"] is history[0]
    device = torch.device("cpu")
    before = [digest(entries[f"optimizer.state[weight].history[{i}]"], device).item() for i in (0, 1)]
    history[0][1000] = 5.0  # elided by repr
    history[1][2] = torch.nextafter(history[1][2], torch.tensor(math.inf))  # one ulp
    after = [digest(entries[f"optimizer.state[weight].history[{i}]"], device).item() for i in (0, 1)]
    assert before[0] != after[0] and before[1] != after[1]
