"""One optimizer step over a rank's part of a global batch: micro-batches, their weights, gradient synchronisation,
mixed precision, clipping, and what a non-finite loss does.

Every micro-batch's loss is weighted by its rows over the global batch's (times the world size, since DDP and FSDP
average gradients over the ranks), so a step's gradient is the mean over the global batch's rows whatever the world
size, the number of micro-batches, and however unevenly an incomplete last batch splits over them. A task whose loss
is a mean over something else (`Task.loss_weight`: a padded language model's target tokens) has its micro-batches
weighted by that count over the global batch's instead, for the same property. Every rank runs the same number of
micro-batches in a step, an empty one where it holds no row of that part of the global batch: FSDP gathers parameters
in every forward and DDP may broadcast buffers there, collectives all ranks must join. The last micro-batch's backward
always synchronises gradients.

With several optimizers (hydraloop.optim) a step is one such pass per optimizer the task names, in its order
(`Task.optimizer_steps`: a GAN's discriminator, then its generator), each over the same batch with the task's loss for
that optimizer (`training_loss(model, batch, optimizer=name)`), stepping that optimizer alone: the gradients of its
parameters are reduced over the ranks (`reduce_gradients`), checked, clipped and scaled as one optimizer's are, and
every gradient is cleared before the next pass. A pass with a non-finite loss (`trainer.nonfinite_loss=skip`) ends the
step as a skipped one: its optimizer and those of the passes after it do not step (those before it have). A task whose
loss is over the whole global batch (contrastive) has its rows gathered over the ranks instead of weighted, and
accumulates in two passes (hydraloop.global_batch).

Once an optimizer's gradients are reduced, every rank holds the same ones (under FSDP, shards of them), and what
follows acts on state every rank holds alike: the callbacks' gradient hooks (`on_before_optimizer_step` sees the
global gradients, unscaled; `on_after_clipping` sees them clipped), clipping and the optimizer's step. Torch's
generators are seeded from the run's seed, the step and the pass alone there (hydraloop.seeding.StepSeeder), as they
are where the task chooses the step's passes, so noise drawn there (and a schedule drawn at random) is the same on
every rank and the same as one process draws.
"""

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from hydraloop.batches import count_rows, slice_rows
from hydraloop.draw_watch import DrawWatch
from hydraloop.global_batch import global_batch_backward
from hydraloop.losses import nonfinite_on_any_rank
from hydraloop.parallel.single import SingleDevice
from hydraloop.precision import Precision
from hydraloop.row_keys import RowKeys
from hydraloop.seeding import CHOOSING_THE_PASSES, StepSeeder
from hydraloop.tasks.base import Task

GradientHooks = Callable[[str, str, Optimizer], None]
"""Called with (the hook: `on_before_optimizer_step` or `on_after_clipping`; the optimizer's name; the optimizer)."""


class OptimizerStep:
    def __init__(
        self,
        strategy: SingleDevice,
        precision: Precision,
        task: Task,
        model: nn.Module,
        optimizers: dict[str, Optimizer],
        *,
        global_batch_size: int,
        grad_accum_steps: int = 1,
        grad_clip_norm: float | None = None,
        skip_nonfinite: bool = False,
        row_keys: RowKeys | None = None,
        seeder: StepSeeder,
        draw_watch: DrawWatch | None = None,
        gradient_hooks: GradientHooks | None = None,
    ) -> None:
        """`model`: the strategy-wrapped model; `optimizers`: by name, one named "" or several (hydraloop.optim);
        `row_keys`: the rows of each micro-batch, for keyed randomness (hydraloop.row_keys; None: no rows, keyed
        draws fall back on torch's); `seeder`: seeds torch's generators before each part of the step; `draw_watch`:
        says when the passes draw from those generators (hydraloop.draw_watch); `gradient_hooks`: the callbacks'
        (None: no callback has one)."""
        self.strategy, self.precision, self.task = strategy, precision, task
        self.model, self.optimizers = model, optimizers
        self.names = list(optimizers)
        self.several = self.names != [""]
        self.params = {name: [p for group in o.param_groups for p in group["params"]] for name, o in optimizers.items()}
        self.world_size = strategy.world_size
        self.grad_accum_steps, self.grad_clip_norm = grad_accum_steps, grad_clip_norm
        self.skip_nonfinite = skip_nonfinite
        # Rows of a micro-batch of a complete global batch, per rank (the launcher checks that they divide).
        self.micro_rows = global_batch_size // (self.world_size * grad_accum_steps)
        self.row_keys = row_keys
        self.seeder, self.gradient_hooks = seeder, gradient_hooks
        self.draw_watch = draw_watch or DrawWatch([], None, False, False)
        self.float_buffers = [buffer for buffer in model.buffers() if buffer.is_floating_point()]

    def __call__(self, batch: Any, global_rows: int, step: int) -> Tensor | None:
        """Optimizer step `step` (counted from 0) over this rank's `batch`, its part of a global batch of
        `global_rows` rows. Returns this rank's share of the global batch's mean loss (the ranks' shares add up to
        it, times the world size; with several optimizers, the sum of their losses), or None if an update was
        skipped for a non-finite loss."""
        if not self.several:
            return self.update("", batch, global_rows, step, 0)
        total, stepped = torch.zeros((), device=self.strategy.device), False
        self.seeder.replicated(step, CHOOSING_THE_PASSES)  # a task that draws its schedule draws it alike everywhere
        try:
            for index, name in enumerate(self.task.optimizer_steps(step, self.names)):
                loss = self.update(name, batch, global_rows, step, index)
                if loss is None:  # the step ends here: no later pass trains against the part that was not updated
                    return None
                total, stepped = total + loss, True
            return total
        finally:
            if stepped:
                self.precision.update()  # the loss scale moves once per step, whatever its passes

    def update(self, name: str, batch: Any, global_rows: int, step: int, index: int) -> Tensor | None:
        """One optimizer's pass over the batch and its update; `index`: the pass's place in the step (its dropout
        masks are its own)."""
        optimizer = self.optimizers[name]
        self.seeder(step, index)  # this rank's own stream, for its rows' dropout
        if self.several:  # every gradient: a pass also reaches parameters another optimizer steps
            self.model.zero_grad(set_to_none=True)
        else:
            optimizer.zero_grad(set_to_none=True)
        # A skipped step must leave the model as it was: its forward pass moved batch norm's running statistics too.
        buffers = [buffer.clone() for buffer in self.float_buffers] if self.skip_nonfinite else []
        micro_batches = self.micro_batches(batch, global_rows)
        with self.draw_watch.watching(step):
            if self.task.global_batch_loss:  # hydraloop.global_batch: one optimizer (checked in the launcher)
                keys = partial(self.keys, step=step, index=index)
                loss_sum = global_batch_backward(self, micro_batches, global_rows, keys)
            else:
                loss_sum = self.backward_passes(name, micro_batches, global_rows, step, index)
        if self.several:
            self.strategy.reduce_gradients(self.model, self.params[name])
        if self.skip_nonfinite and nonfinite_on_any_rank(loss_sum, self.strategy):
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for buffer, saved in zip(self.float_buffers, buffers):
                    buffer.copy_(saved)
            return None
        self.seeder.replicated(step, index)  # from here on, every rank acts alike on the same gradients
        with self.strategy.whole_tensor_draws():
            self.clip_and_step(name, optimizer)
        return loss_sum

    def backward_passes(self, name: str, micro_batches: list, global_rows: int, step: int, index: int) -> Tensor:
        """The forward and backward passes of an optimizer's pass over this rank's micro-batches, each weighted by
        its share of the global batch; returns this rank's share of the step's loss."""
        shares = self.loss_shares(micro_batches)
        last = len(micro_batches) - 1
        loss_sum = None
        for i, (micro_batch, first_row, rows) in enumerate(micro_batches):
            keys = self.keys(first_row, rows, step=step, index=index)
            with self.strategy.no_sync(self.model) if i < last else nullcontext():
                with self.precision.autocast(), keys:
                    if self.several:
                        loss = self.task.training_loss(self.model, micro_batch, optimizer=name)
                    else:
                        loss = self.task.training_loss(self.model, micro_batch)
                if not rows:
                    # A mean over no rows is NaN; times 0 it still reaches every parameter the forward pass used,
                    # with a zero gradient: this rank joins the gradient reduction with nothing to add.
                    self.precision.backward(loss * 0.0)
                    continue
                if shares is None:
                    # The micro-batch's share of the global batch: rows / global_rows, times the world size, since
                    # DDP and FSDP average over the ranks (1 without accumulation; 1 / grad_accum_steps for a whole
                    # batch).
                    divisor = global_rows / (rows * self.world_size)
                    weighted = loss if divisor == 1.0 else loss / divisor
                else:
                    weighted = loss * shares[i]
                self.precision.backward(weighted)
            loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
        if loss_sum is None:  # no row here at all
            loss_sum = torch.zeros((), device=self.strategy.device)
        return loss_sum

    def keys(self, first_row: int, rows: int, *, step: int, index: int) -> AbstractContextManager:
        """The rows' context of a micro-batch, for keyed draws (none without row keys)."""
        return self.row_keys(step, first_row, rows, index) if self.row_keys else nullcontext()

    def clip_and_step(self, name: str, optimizer: Optimizer) -> None:
        """The optimizer's step on its reduced gradients: the gradient hooks, clipping, and the step itself."""
        hooks = self.gradient_hooks
        if self.grad_clip_norm is not None or hooks:
            self.precision.unscale_(optimizer)  # the clip threshold, and the hooks, see true gradients
        if hooks:
            hooks("on_before_optimizer_step", name, optimizer)
        if self.grad_clip_norm is not None:
            # DDP has averaged the gradients by now, so every rank clips by the same global norm. Under FSDP each
            # rank holds a shard (DTensor) of them, and clip_grad_norm_ takes the norm over all shards.
            nn.utils.clip_grad_norm_(self.params[name], self.grad_clip_norm)
        if hooks:
            hooks("on_after_clipping", name, optimizer)
        self.precision.step(optimizer, update=not self.several)

    def loss_shares(self, micro_batches: list[tuple[Any, int, int]]) -> Tensor | None:
        """For a task that weights its loss by a count of its own (`Task.loss_weight`: tokens, say), each
        micro-batch's share of the global batch's count, times the world size (as rows / global_rows is otherwise);
        None for rows. The global count is one all-reduce, on the device: no host sync."""
        counts = [self.task.loss_weight(micro_batch) for micro_batch, _, _ in micro_batches]
        if counts[0] is None:
            return None
        counts = torch.stack([torch.as_tensor(c, device=self.strategy.device).reshape(()) for c in counts]).long()
        total = self.strategy.all_reduce(counts.sum()).clamp(min=1)  # a global batch of no tokens: shares of 0
        return (counts * self.world_size).float() / total.float()

    def micro_batches(self, batch: Any, global_rows: int) -> list[tuple[Any, int, int]]:
        """(micro-batch, its first row in the batch, its rows) for each part of the global batch that holds a row:
        the same number on every rank."""
        rows = count_rows(batch)
        if self.grad_accum_steps == 1:
            return [(batch, 0, rows)]
        size = self.micro_rows
        count = math.ceil(global_rows / (size * self.world_size))
        return [
            (slice_rows(batch, i * size, (i + 1) * size), i * size, max(0, min(size, rows - i * size)))
            for i in range(count)
        ]
