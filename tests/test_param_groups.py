"""Named parameter groups (optimizer.no_weight_decay, no_weight_decay_names, lr_scales) and warm-up in steps."""

import pytest
import torch
from hydra.utils import instantiate

from conftest import compose_train
from hydraloop.errors import ConfigError
from hydraloop.optim import build_optimizer, check_parameter_groups


def test_no_weight_decay_leaves_biases_and_norms_undecayed():
    # Zero gradients: AdamW's update is then the decay alone, lr * weight_decay * weight, on decayed parameters.
    cfg = compose_train("experiment=text_gpt", "optimizer.lr=0.1", "optimizer.weight_decay=0.5")
    assert cfg.optimizer.no_weight_decay is True
    model = instantiate(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for name, param in model.named_parameters():
        if param.ndim < 2:  # LayerNorm weights and biases
            assert torch.equal(param, before[name]), name
        else:  # matmul weights and the (tied) token embedding
            torch.testing.assert_close(param, before[name] * (1 - 0.1 * 0.5))


def test_lr_scales_by_pattern_follow_the_schedule():
    cfg = compose_train(
        "scheduler=cosine", "scheduler.warmup_steps=4", "optimizer.lr=0.01", "optimizer.lr_scales=[[net.1.*,0.1]]"
    )
    model = instantiate(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    scaled = {id(p) for name, p in model.named_parameters() if name.startswith("net.1.")}
    scales = [(0.1 if id(group["params"][0]) in scaled else 1.0) for group in optimizer.param_groups]
    assert sorted(scales) == [0.1, 1.0]
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=20, steps_per_epoch=5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    for group, scale in zip(optimizer.param_groups, scales):
        assert group["lr"] == pytest.approx(0.01 * scale)  # step 3 of a 4-step warm-up: the peak


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "optimizer.no_weight_decay_names=[head.*]",
            "optimizer.no_weight_decay_names: the pattern 'head.*' matches",
        ),
        ("optimizer.lr_scales=[[blockz.*,0.1]]", "optimizer.lr_scales: the pattern 'blockz.*' matches no parameter"),
        ("optimizer.lr_scales=[[net.*,0]]", "optimizer.lr_scales=[['net.*', 0]]: the scale of 'net.*' is 0"),
        ("optimizer.no_weight_decay=1", "optimizer.no_weight_decay=1: must be true or false"),
    ],
)
def test_bad_grouping_is_one_line(override, message):
    cfg = compose_train(override)
    with torch.device("meta"), pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("*", r"\*")):
        check_parameter_groups(cfg.optimizer, instantiate(cfg.model))


def test_warmup_in_steps_and_its_refusals():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cfg = compose_train("scheduler=cosine", "scheduler.warmup_steps=3")
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=10, steps_per_epoch=100)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 / 3)  # independent of the 100 steps per epoch
    both = compose_train("scheduler=cosine", "scheduler.warmup_steps=3", "scheduler.warmup_epochs=1")
    with pytest.raises(ConfigError, match="give one or the other"):
        instantiate(both.scheduler)(optimizer, total_steps=10, steps_per_epoch=5)
    with pytest.raises(ConfigError, match=r"^scheduler.warmup_steps=3: a warm-up of 3 steps passes the run's 2 steps"):
        instantiate(cfg.scheduler)(optimizer, total_steps=2, steps_per_epoch=5)
    assert scheduler.get_last_lr()[0] == pytest.approx(1 / 3)


def test_a_submodule_called_module_is_not_taken_for_a_wrapper():
    # Only DDP's and DataParallel's wrappers are unwrapped: a user's own `.module` must keep the whole model's
    # parameters in the optimizer and its whole state in the checkpoint.
    from hydraloop.parallel.single import SingleDevice

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.head = torch.nn.Linear(2, 1)

    strategy = SingleDevice("cpu")
    strategy.setup()
    model = strategy.wrap(Outer())
    optimizer = build_optimizer(compose_train().optimizer, strategy.unwrap(model))
    assert sum(len(group["params"]) for group in optimizer.param_groups) == 4
    model_state, _ = strategy.state_dicts(model, {"": optimizer})()
    assert set(model_state) == {"module.weight", "module.bias", "head.weight", "head.bias"}


def test_frozen_parameters_are_in_no_group():
    # model=hf's LoRA freezes the model: its weights must take no optimizer state, no decay, no part of a pattern's
    # match (a pattern matching only frozen weights is refused like one matching nothing).
    cfg = compose_train("optimizer.no_weight_decay=true", "optimizer.lr_scales=[[net.1.*,0.1]]")
    model = instantiate(cfg.model)
    model.net[1].requires_grad_(False)
    optimizer = build_optimizer(cfg.optimizer, model)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.parameters() if p.requires_grad} and trained
    with pytest.raises(ConfigError, match=r"^optimizer.lr_scales: the pattern 'net.1.\*' matches no parameter"):
        check_parameter_groups(cfg.optimizer, model)
