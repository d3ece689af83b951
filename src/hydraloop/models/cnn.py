import math
from collections.abc import Sequence

from torch import Tensor, nn

from hydraloop.errors import require
from hydraloop.keyed_dropout import KeyedDropout
from hydraloop.models.mlp import check_sizes


class CNN(nn.Module):
    """Conv-ReLU-MaxPool blocks and an MLP head; 1-D convolutions for (C, L) inputs, 2-D for (C, H, W).

    A flat (L,) input is read as one channel of length L, so every data set works with it.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        kernel_size: int = 3,
        hidden_size: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        shape = list(input_shape) if len(input_shape) > 1 else [1, *input_shape]
        require(len(shape) in (2, 3), f"data.input_shape={list(input_shape)}: model=cnn takes (C, L) or (C, H, W)")
        check_sizes("channels", channels)
        check_sizes("hidden_size", [hidden_size])
        # Odd: `padding=kernel_size // 2` then keeps each layer's length, which the head's width is computed from.
        require(
            isinstance(kernel_size, int) and kernel_size > 0 and kernel_size % 2 == 1,
            f"model.kernel_size={kernel_size}: must be a positive odd number",
        )
        require(0 <= dropout < 1, f"model.dropout={dropout}: must be in [0, 1)")
        conv, pool = (nn.Conv1d, nn.MaxPool1d) if len(shape) == 2 else (nn.Conv2d, nn.MaxPool2d)
        self.input_shape = shape
        in_channels, spatial = shape[0], shape[1:]
        layers: list[nn.Module] = []
        for out_channels in channels:
            layers += [conv(in_channels, out_channels, kernel_size, padding=kernel_size // 2), nn.ReLU()]
            if min(spatial) >= 2:  # stop pooling once a dimension would vanish (8x8 digits allow two pools)
                layers.append(pool(2))
                spatial = [s // 2 for s in spatial]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        head: list[nn.Module] = [nn.Flatten(), nn.Linear(in_channels * math.prod(spatial), hidden_size), nn.ReLU()]
        if dropout > 0:
            head.append(KeyedDropout(dropout, key=0))  # the same masks under every strategy
        self.head = nn.Sequential(*head, nn.Linear(hidden_size, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))
