"""Mixed precision: autocast for the forward pass and loss; a GradScaler for fp16, whose range needs it."""

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.optim import Optimizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, precision: str, device: torch.device) -> None:
        self.dtype = DTYPES.get(str(precision))
        self.device_type = device.type
        # Disabled (a pass-through) unless fp16: bf16 has float32's range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype is torch.float16)

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()  # float32: not even a disabled autocast, which costs a few µs per step
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: Optimizer) -> None:
        """Before gradient clipping, so the clip threshold applies to true gradients."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer, update: bool = True) -> None:
        """`update`: the loss scale's update, once per optimizer step of the loop; with several optimizers the loop
        calls `update` itself after the step's last one (as torch documents GradScaler for several optimizers)."""
        # With fp16 the scaler skips steps whose gradients overflowed (a host sync, inherent to loss scaling).
        self.scaler.step(optimizer)
        if update:
            self.scaler.update()

    def update(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)
