"""SimCLR (Chen et al. 2020): two augmented views of each image, embedded by the model, and the NT-Xent loss over the
global batch's 2B embeddings: each view's positive is its sample's other view, its negatives the other 2B - 2.

The views are drawn per sample with hydraloop.keyed_random (a shift of up to `shift` pixels, a brightness scale,
Gaussian noise, erased pixels), so a sample's views are the same in one process and on any rank, in either pass of
accumulation, and after a resume. The loss is over the global batch (hydraloop.tasks.global_batch): the loop gathers
the ranks' embeddings, so ddp and fsdp train what one process trains.

Validation reports, over each validation batch: val/loss (NT-Xent), val/acc (a view's nearest embedding is its
positive) and val/knn_acc (a sample's nearest other sample, by first views, has its label: a label-free
representation's quality, read with the labels).
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop import keyed_random as keyed
from hydraloop.errors import require
from hydraloop.tasks.base import call, count
from hydraloop.tasks.global_batch import GlobalBatchTask


class Contrastive(GlobalBatchTask):
    metrics = {"val/knn_acc": "max", "val/acc": "max", "val/loss": "min"}
    default_metric = "val/knn_acc"  # what the representation is for; val/acc is what the loss trains
    num_statistics = 4  # NT-Xent sum over views, positives found, nearest samples of the same label, views

    def __init__(
        self, temperature: float = 0.2, shift: int = 1, brightness: float = 0.2, noise: float = 0.1, erase: float = 0.1
    ) -> None:
        require(temperature > 0, f"task.temperature={temperature}: must be positive")
        require(shift >= 0, f"task.shift={shift}: a number of pixels, at least 0")
        require(0.0 <= erase < 1.0, f"task.erase={erase}: a fraction of pixels, at least 0 and below 1")
        self.temperature, self.shift, self.brightness, self.noise, self.erase = (
            temperature,
            shift,
            brightness,
            noise,
            erase,
        )

    def embed(self, model: Any, batch: Any) -> tuple[Tensor, Tensor]:
        """(Each sample's two views' embeddings, unit length: (rows, 2, dim); its labels)."""
        images, labels = self.split(batch)
        # Both views in one forward pass (one DDP forward per backward), interleaved so that a row's two views are
        # neighbours: keyed dropout in the model reads (rows * 2) as each row's two entries.
        views = torch.stack([self.view(images, 0), self.view(images, 1)], dim=1)
        embeddings = call(model, views.flatten(0, 1)).float()
        return F.normalize(embeddings, dim=-1).view(len(images), 2, embeddings.shape[-1]), labels

    def view(self, images: Tensor, which: int) -> Tensor:
        """A random view of (rows, channels, height, width) images, keyed by the sample and `which`."""
        rows, _, height, width = images.shape
        s = self.shift
        padded = F.pad(images, (s, s, s, s))
        dy, dx = (keyed.integers(0, 2 * s + 1, (rows,), key=(axis, which), device=images.device) for axis in "yx")
        ys = (torch.arange(height, device=images.device) + dy[:, None])[:, None, :, None]
        xs = (torch.arange(width, device=images.device) + dx[:, None])[:, None, None, :]
        shifted = padded.gather(2, ys.expand(-1, padded.shape[1], -1, padded.shape[3]))
        shifted = shifted.gather(3, xs.expand(-1, padded.shape[1], height, -1))
        scale = 1.0 + self.brightness * (
            2.0 * keyed.uniform((rows, 1, 1, 1), key=("scale", which), device=images.device) - 1.0
        )
        noisy = shifted * scale + self.noise * keyed.normal_like(shifted, key=("noise", which))
        return noisy.masked_fill(
            keyed.bernoulli(self.erase, tuple(noisy.shape), key=("erase", which), device=images.device), 0.0
        )

    def batch_loss(self, rows: tuple[Tensor, Tensor]) -> Tensor:
        return self._per_view(rows[0])[0].mean()

    def batch_statistics(self, rows: tuple[Tensor, Tensor]) -> Tensor:
        embeddings, labels = rows
        losses, found = self._per_view(embeddings)
        first = embeddings[:, 0]
        similarity = first @ first.T
        similarity.fill_diagonal_(-float("inf"))
        same_label = (
            labels[similarity.argmax(dim=1)] == labels
            if len(labels) > 1
            else torch.zeros_like(labels, dtype=torch.bool)
        )
        per_row = [losses.view(-1, 2).sum(dim=1), found.view(-1, 2).sum(dim=1), same_label]
        return torch.stack([*(s.double() for s in per_row), count(embeddings, 2).expand(len(labels))], dim=1)

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        loss_sum, found, same_label, views = totals
        return {"val/knn_acc": 2 * same_label / views, "val/acc": found / views, "val/loss": loss_sum / views}

    def _per_view(self, embeddings: Tensor) -> tuple[Tensor, Tensor]:
        """NT-Xent per view of (rows, 2, dim) embeddings, and whether its nearest other view is its positive."""
        flat = embeddings.flatten(0, 1)  # view v of row i is 2i + v; its positive is 2i + 1 - v, i.e. index ^ 1
        logits = flat @ flat.T / self.temperature
        logits.fill_diagonal_(-float("inf"))
        positives = torch.arange(len(flat), device=flat.device) ^ 1
        return F.cross_entropy(logits, positives, reduction="none"), logits.argmax(dim=1) == positives
