"""User code that draws random numbers on the state every rank holds alike, for tests/test_step_randomness.py: an
optimizer and a callback, selected from the command line, e.g.
`optimizer._target_=tests.randomness.NoisyAdamW +optimizer.sigma=0.01`,
`+callbacks.noise._target_=tests.randomness.GradientNoise`."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from hydraloop.callbacks import Callback


class NoisyAdamW(torch.optim.AdamW):
    """AdamW whose step also moves every parameter by `sigma` times a standard normal draw (a Langevin-style
    update): randomness in the optimizer step itself."""

    def __init__(self, params: Any, sigma: float = 0.01, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.sigma = sigma

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(torch.randn_like(param), alpha=self.sigma)
        return loss


class GradientNoise(Callback):
    """Adds `sigma` times a standard normal draw to every gradient before clipping (Neelakantan et al. 2015), and
    counts the calls of each gradient hook per optimizer (saved with the checkpoint)."""

    def __init__(self, sigma: float = 0.01) -> None:
        self.sigma = sigma
        self.calls: dict[str, int] = {}

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: Any, state: Any, optimizer_name: str, optimizer: Optimizer) -> None:
        self._count(f"before_optimizer_step/{optimizer_name}")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.add_(torch.randn_like(param.grad), alpha=self.sigma)

    def on_after_clipping(self, trainer: Any, state: Any, optimizer_name: str, optimizer: Optimizer) -> None:
        self._count(f"after_clipping/{optimizer_name}")

    def _count(self, key: str) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1

    def state_dict(self, trainer: Any) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, trainer: Any, state: dict[str, Any]) -> None:
        self.calls = dict(state["calls"])
