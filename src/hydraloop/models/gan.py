"""A generative adversarial network of two MLPs: `generator` (latent -> sample) and `discriminator` (sample -> one
logit). Two parts, each trained by an optimizer of its own (optimizer=gan); the task calls them (tasks.gan)."""

from torch import Tensor, nn


def _mlp(widths: list[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(widths) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class GAN(nn.Module):
    def __init__(self, latent_dim: int, sample_dim: int, hidden_sizes: list[int]) -> None:
        super().__init__()
        if latent_dim <= 0 or sample_dim <= 0 or any(width <= 0 for width in hidden_sizes):
            raise ValueError(f"widths must be positive: latent_dim {latent_dim}, hidden_sizes {list(hidden_sizes)}")
        self.generator = _mlp([latent_dim, *hidden_sizes, sample_dim], nn.ReLU)
        self.discriminator = _mlp([sample_dim, *hidden_sizes, 1], lambda: nn.LeakyReLU(0.2))

    def forward(self, latents: Tensor) -> Tensor:
        """Samples from latents: the generator (what mode=predict and a model called by hand get)."""
        return self.generator(latents)
