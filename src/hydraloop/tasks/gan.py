"""Adversarial training with two optimizers (docs/optimizers-and-callbacks.md): the discriminator steps first, on real
samples against the generator's (detached), then the generator, to make the discriminator call its samples real
(the non-saturating loss of Goodfellow et al. 2014). `n_critic`: the discriminator's updates per generator update.

Validation measures the generator on a ring of Gaussians (data=ring) as the mode-collapse literature does (Metz et
al. 2017; Srivastava et al. 2017): `val/high_quality`, the fraction of samples within 3 standard deviations of a
mode's centre, and `val/modes`, the modes that hold at least a quarter of their even share of those samples. A
collapsed generator scores high quality on few modes; a blurred one covers every mode with few good samples.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hydraloop.data.gaussians import mode_centres
from hydraloop.errors import require
from hydraloop.tasks.base import Task


class AdversarialRing(Task):
    metrics = {"val/modes": "max", "val/high_quality": "max", "val/d_loss": "min", "val/g_loss": "min"}
    default_metric = "val/modes"

    def __init__(self, modes: int, radius: float, std: float, n_critic: int = 1) -> None:
        require(n_critic >= 1, f"task.n_critic={n_critic}: must be at least 1")
        self.modes, self.std, self.n_critic = modes, std, n_critic
        self.centres = mode_centres(modes, radius)
        self.num_statistics = 4 + modes  # samples, d_loss sum, g_loss sum, high quality, per mode

    def optimizer_steps(self, step: int, optimizers: list[str]) -> list[str]:
        if step % self.n_critic == self.n_critic - 1:
            return ["discriminator", "generator"]
        return ["discriminator"]

    def training_loss(self, model: Any, batch: Any, optimizer: str) -> Tensor:
        """The loss `optimizer` minimises on a (micro-)batch of (real samples, latents): a mean over its rows."""
        real, latents = batch
        if optimizer == "discriminator":
            with torch.no_grad():
                fake = model.generator(latents)
            return self.d_loss(model.discriminator(real), model.discriminator(fake)).mean()
        return self.g_loss(model.discriminator(model.generator(latents))).mean()

    @staticmethod
    def d_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
        """Per row: real samples called real, generated ones fake."""
        real = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits), reduction="none")
        fake = F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits), reduction="none")
        return (real + fake).squeeze(1)

    @staticmethod
    def g_loss(fake_logits: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits), reduction="none").squeeze(
            1
        )

    def validation_statistics(self, model: Any, batch: Any) -> Tensor:
        real, latents = batch
        fake = model.generator(latents)
        fake_logits = model.discriminator(fake)
        d_loss = self.d_loss(model.discriminator(real), fake_logits).double().sum()
        g_loss = self.g_loss(fake_logits).double().sum()
        distances = torch.cdist(fake.double(), self.centres.to(fake.device))  # (rows, modes)
        nearest = distances.min(dim=1)
        good = nearest.values < 3 * self.std
        per_mode = torch.bincount(nearest.indices[good], minlength=self.modes).double()
        n = torch.full((1,), len(real), dtype=torch.float64, device=fake.device)
        return torch.cat([n, d_loss.reshape(1), g_loss.reshape(1), good.double().sum().reshape(1), per_mode])

    def metrics_from(self, totals: list[float]) -> dict[str, float]:
        n, d_loss, g_loss, good, per_mode = totals[0], totals[1], totals[2], totals[3], totals[4:]
        even_share = good / self.modes
        covered = sum(count >= even_share / 4 for count in per_mode) if good else 0
        return {
            "val/modes": float(covered),
            "val/high_quality": good / n,
            "val/d_loss": d_loss / n,
            "val/g_loss": g_loss / n,
        }

    def predict(self, model: Any, inputs: Any) -> dict[str, Tensor]:
        """mode=predict: samples from the latents given as inputs."""
        return {"samples": model.generator(inputs).float()}

    def check_sample(self, sample: Any, where: str) -> None:
        require(
            isinstance(sample, (tuple, list)) and len(sample) == 2,
            f"{where}: {type(self).__name__} takes samples of (point, latent), as data=ring gives",
        )
