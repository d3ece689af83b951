"""A user's own randomness, for tests: a data set split with `random_split` (no generator of its own), and a task
that draws input noise per sample in `training_loss`, from torch's generator or keyed (hydraloop.keyed_random)."""

import json
import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset, random_split

from hydraloop import keyed_random as keyed
from hydraloop.tasks.base import call
from hydraloop.tasks.classification import Classification


def split_blobs(num_samples: int = 240, record: str | None = None, **_) -> tuple:
    """Gaussian blobs of 4 classes in 8 dimensions (fixed), split 3:1 by `random_split` from torch's global
    generator; `record`: a file each process appends its training indices to. (Other keys, those of the data
    config it stands in for, are ignored.)"""
    generator = torch.Generator().manual_seed(1)
    y = torch.arange(num_samples) % 4
    x = torch.randn(num_samples, 8, generator=generator) + 2.0 * torch.eye(8)[y]
    train, val = random_split(TensorDataset(x, y), [num_samples * 3 // 4, num_samples // 4])
    if record:
        with Path(record).open("a") as file:
            file.write(json.dumps({"pid": os.getpid(), "indices": list(train.indices)}) + "\n")
    return train, val


class NoisyInputs(Classification):
    """Classification of inputs with Gaussian noise added per sample in training: `keyed` draws it with
    hydraloop.keyed_random, else from torch's generator (per rank)."""

    def __init__(self, num_classes: int, noise: float = 0.5, keyed: bool = True, **kwargs) -> None:
        super().__init__(num_classes, **kwargs)
        self.noise, self.keyed = noise, keyed

    def training_loss(self, model, batch):
        x, y = batch
        noise = keyed.normal_like(x, key="inputs") if self.keyed else torch.randn_like(x)
        return self.loss(call(model, x + self.noise * noise), y)
