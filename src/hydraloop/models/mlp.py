import math
from collections.abc import Sequence

from torch import Tensor, nn

from hydraloop.errors import require
from hydraloop.keyed_dropout import KeyedDropout


class MLP(nn.Module):
    """Flattens any input shape, then Linear-ReLU(-Dropout) blocks and a linear classifier. The dropout is keyed
    (hydraloop.keyed_dropout): the same masks under every strategy."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden_sizes: Sequence[int] = (128, 128),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_sizes("hidden_sizes", hidden_sizes)
        require(0 <= dropout < 1, f"model.dropout={dropout}: must be in [0, 1)")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for index, hidden in enumerate(hidden_sizes):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(KeyedDropout(dropout, key=index))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def check_sizes(key: str, sizes: Sequence[int]) -> None:
    """Layer widths: positive integers (torch would fail later, in every rank, at a negative one)."""
    require(
        all(isinstance(size, int) and size > 0 for size in sizes),
        f"model.{key}={list(sizes)}: must be positive integers",
    )
