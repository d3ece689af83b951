"""Seeds: every value is honoured (0 included), runs repeat exactly, and workers or determinism change nothing."""

import torch

from conftest import max_param_diff, read_checkpoint


def weights(run_dir):
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


def test_seed_zero_is_a_seed(train_in_process):
    common = ("trainer.max_epochs=2", "logger=none", "model.dropout=0.3")
    _, zero_a = train_in_process("seed=0", *common)
    _, zero_b = train_in_process("seed=0", *common)
    _, other = train_in_process("seed=1234", *common)
    assert max_param_diff(weights(zero_a), weights(zero_b)) == 0.0  # dropout included: exactly repeatable
    assert max_param_diff(weights(zero_a), weights(other)) > 1e-3


def test_dataloader_workers_do_not_change_the_result(train_in_process):
    _, in_process = train_in_process("trainer.max_epochs=2", "logger=none", "data.num_workers=0")
    _, workers = train_in_process("trainer.max_epochs=2", "logger=none", "data.num_workers=2")
    assert max_param_diff(weights(in_process), weights(workers)) == 0.0


def test_deterministic_mode(train_in_process):
    try:
        metrics, deterministic = train_in_process("trainer.max_epochs=1", "logger=none", "trainer.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    _, default = train_in_process("trainer.max_epochs=1", "logger=none")
    assert max_param_diff(weights(deterministic), weights(default)) == 0.0  # on CPU the kernels agree anyway
