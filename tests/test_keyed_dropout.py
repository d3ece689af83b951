"""KeyedDropout: a sample's mask depends on the sample, the step and the layer, not on how the batch was split."""

import pytest
import torch
from torch import nn

from conftest import max_param_diff
from hydraloop.activation_checkpointing import checkpoint_activations
from hydraloop.keyed_dropout import KeyedDropout, key_functional_dropout
from hydraloop.parallel.dataparallel import keyed_replicas
from hydraloop.row_keys import RowKeys

CPU = torch.device("cpu")


def dropped(layer: nn.Module, x: torch.Tensor, step: int, rank: int = 0, world_size: int = 1, first_row: int = 0):
    with RowKeys(seed=0, rank=rank, world_size=world_size, device=CPU)(step, first_row, len(x)):
        return layer(x)


@pytest.fixture
def layer() -> KeyedDropout:
    return KeyedDropout(0.5, key=3).train()


def test_ranks_and_micro_batches_draw_the_single_process_masks(layer):
    x = torch.ones(8, 4, 5)
    whole = dropped(layer, x, step=7)
    # Two ranks: the sampler deals the global batch's rows to the ranks in turn (rank r: rows r, r+2, ...).
    by_rank = [dropped(layer, x[:4], step=7, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.stack(by_rank, dim=1).reshape(8, 4, 5), whole)
    # Two micro-batches of one process: the second starts at row 4.
    micro = [dropped(layer, x[:4], step=7), dropped(layer, x[4:], step=7, first_row=4)]
    assert torch.equal(torch.cat(micro), whole)


def test_masks_differ_by_step_and_layer_and_keep_one_minus_p(layer):
    x = torch.ones(256, 256)
    mask = dropped(layer, x, step=7) > 0
    assert not torch.equal(dropped(layer, x, step=8) > 0, mask)
    assert not torch.equal(dropped(KeyedDropout(0.5, key=4).train(), x, step=7) > 0, mask)
    assert mask.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert dropped(layer, x, step=7)[mask].unique().tolist() == [2.0]  # kept values scaled by 1 / (1 - p)


def test_outside_training_it_is_plain_dropout(layer):
    x = torch.ones(64, 64)
    assert torch.equal(layer.eval()(x), x)
    layer.train()
    torch.manual_seed(0)
    expected = nn.functional.dropout(x, 0.5, training=True)
    torch.manual_seed(0)
    assert torch.equal(layer(x), expected)  # no loop around it: the generator's masks


def test_dataparallel_replicas_get_their_rows_of_the_batch(layer):
    """DataParallel scatters the batch's rows in order; each replica must mask its rows as the whole batch would."""
    x = torch.ones(6, 10)
    whole = dropped(layer, x, step=2)
    with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(2, 0, 6):
        replicas = keyed_replicas([layer, layer], [(x[:4],), (x[4:],)])
    parts = [replica(args[0]) for replica, args in zip(replicas, [(x[:4],), (x[4:],)])]  # as their threads call them
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.slow
def test_an_mlp_with_dropout_under_ddp_ends_with_singles_weights(run_train):
    recipe = ("experiment=mnist1d_mlp", "trainer.max_epochs=2", "logger=none")
    single, ddp = run_train(*recipe), run_train(*recipe, "parallel=ddp")
    assert single.returncode == 0 and ddp.returncode == 0, single.output + ddp.output
    assert max_param_diff(ddp.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
    assert ddp.metrics["val/acc"] == single.metrics["val/acc"]


def test_a_tokens_mask_does_not_depend_on_how_long_the_batch_is_padded(layer):
    """Each rank and micro-batch pads to its own longest sample: position t of a sample keeps its mask."""
    short, padded = torch.ones(3, 5, 4), torch.ones(3, 9, 4)
    assert torch.equal(dropped(layer, padded, step=1)[:, :5], dropped(layer, short, step=1))
    attention = torch.ones(3, 2, 9, 9)  # (batch, heads, queries, keys): padded in two dimensions
    assert torch.equal(dropped(layer, attention, step=1)[:, :, :5, :5], dropped(layer, attention[:, :, :5, :5], step=1))


class CallsDropout(nn.Module):
    """A linear layer whose dropout is a function call, as OPT's are, on its rows and tokens flattened together."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x).flatten(0, 1), 0.5, training=self.training).view_as(x)


def calls_dropout() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(CallsDropout(), CallsDropout()).train()
    key_functional_dropout(model)
    return model


def test_functional_dropout_is_keyed_by_its_order_in_the_forward_pass():
    model, x = calls_dropout(), torch.randn(8, 3, 4)
    whole = dropped(model, x, step=7)
    # Each call below is a forward pass of its own: its calls count from the first again, as the whole batch's did.
    by_rank = [dropped(model, x[r::2], step=7, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.stack(by_rank, dim=1).reshape(whole.shape), whole)
    micro = [dropped(model, x[:4], step=7), dropped(model, x[4:], step=7, first_row=4)]
    assert torch.equal(torch.cat(micro), whole)
    torch.manual_seed(0)
    outside = model(x)  # no loop around it: torch's masks
    torch.manual_seed(0)
    assert torch.equal(model(x), outside) and not torch.equal(outside, whole)


def test_a_recomputed_block_draws_the_functional_masks_its_forward_drew():
    """The second block's calls are the forward pass's second and later: the recomputation, in the backward pass
    where the loop has set no rows, must count from there, with the forward's rows."""
    x = torch.randn(6, 5, 4)

    def gradients(recompute: bool) -> list[torch.Tensor]:
        model = calls_dropout()
        if recompute:
            checkpoint_activations(model, ["CallsDropout"])
        with RowKeys(seed=0, rank=0, world_size=1, device=CPU)(2, 0, len(x)):
            loss = model(x).square().sum()
        loss.backward()  # as the loop's: outside its rows
        return [parameter.grad for parameter in model.parameters()]

    assert all(torch.equal(once, recomputed) for once, recomputed in zip(gradients(False), gradients(True)))
