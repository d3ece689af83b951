"""A ring of Gaussians in the plane: the toy distribution GAN papers measure mode collapse on (Metz et al. 2017,
Unrolled GANs; Srivastava et al. 2017, VEEGAN). Each sample is (a point of the ring, a latent vector): the latent is
part of the data set, so every rank, and every micro-batch, feeds the generator the noise single-process training
feeds it, row by row."""

import math

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from hydraloop.errors import require


def mode_centres(modes: int, radius: float) -> Tensor:
    """The `modes` centres, evenly spaced on a circle of `radius` (mode 0 on the x axis)."""
    angles = torch.arange(modes, dtype=torch.float64) * (2 * math.pi / modes)
    return radius * torch.stack([angles.cos(), angles.sin()], dim=1)


def make_ring(
    num_train: int,
    num_val: int,
    modes: int = 8,
    radius: float = 2.0,
    std: float = 0.02,
    latent_dim: int = 2,
    seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Training and validation sets of (point, latent) pairs: each point from a mode chosen uniformly, with
    isotropic noise `std`; each latent standard normal."""
    for key, value in (("num_train", num_train), ("num_val", num_val), ("modes", modes), ("latent_dim", latent_dim)):
        require(value > 0, f"data.dataset.{key}={value}: must be positive")
    require(radius > 0 and std > 0, f"data.dataset.radius={radius}, std={std}: must be positive")
    generator = torch.Generator().manual_seed(seed)
    count = num_train + num_val
    mode = torch.randint(modes, (count,), generator=generator)
    points = mode_centres(modes, radius).float()[mode] + std * torch.randn(count, 2, generator=generator)
    latents = torch.randn(count, latent_dim, generator=generator)
    return (
        TensorDataset(points[:num_train], latents[:num_train]),
        TensorDataset(points[num_train:], latents[num_train:]),
    )
