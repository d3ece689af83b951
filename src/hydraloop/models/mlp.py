import math
from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Flattens any input shape, then Linear-ReLU(-Dropout) blocks and a linear classifier."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden_sizes: Sequence[int] = (128, 128),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
