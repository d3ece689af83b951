"""A task whose loss is over the whole global batch, not a mean over rows: a contrastive loss (SimCLR's NT-Xent,
CLIP's), any loss with in-batch negatives.

Computed per rank, such a loss sees the rank's shard only (B/N samples, and their negatives among them): another
objective than one process's over B samples. A `GlobalBatchTask` says what each row gives (`embed`) and what the
loss of the whole batch's rows is (`batch_loss`); the loop (hydraloop.global_batch) gathers every rank's rows into the
global batch, in its order, and gives each rank the gradient of the global loss through its own rows: ddp and fsdp
then train what one process trains, and gradient accumulation does too, in two passes (GradCache): the micro-batches'
rows first, without gradients, then each micro-batch again, with the global loss's gradient for its rows.

Validation gathers the same way (the global validation batch is one process's batch): `batch_statistics` gives each
row's sums and counts, and each rank adds those of its own rows, so each sample counts once.

In one process with the whole batch (the launcher's trial batch, a model called by hand), `training_loss` and
`validation_statistics` are the same functions of the batch's own rows.
"""

from typing import Any, ClassVar

from torch import Tensor

from hydraloop.tasks.base import Task


class GlobalBatchTask(Task):
    global_batch_loss: ClassVar[bool] = True

    def embed(self, model: Any, batch: Any) -> Any:
        """What each row of a (micro-)batch gives the loss: a tensor, or a tuple or dict of them, rows first
        (embeddings, and anything else the loss reads, such as labels). Keyed draws here (hydraloop.keyed_random)
        are the same in both passes of accumulation; draws from torch's generators would not be."""
        raise NotImplementedError

    def batch_loss(self, rows: Any) -> Tensor:
        """The loss of the global batch from `embed`'s outputs of all its rows, in the global batch's order: a
        scalar, the loss one process computes over the whole batch."""
        raise NotImplementedError

    def batch_statistics(self, rows: Any) -> Tensor:
        """Validation's sums and counts from `embed`'s outputs of a whole validation batch: a float64 tensor
        (rows, num_statistics), each row's contributions (`statistics`' for a loss that is a mean over rows)."""
        raise NotImplementedError

    def training_loss(self, model: Any, batch: Any) -> Tensor:
        return self.batch_loss(self.embed(model, batch))

    def validation_statistics(self, model: Any, batch: Any) -> Tensor:
        return self.batch_statistics(self.embed(model, batch)).sum(dim=0)
