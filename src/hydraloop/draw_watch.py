"""Loud where a run is not exact: code that draws from torch's default generators in a pass whose batch is split.

Under ddp or fsdp, and with gradient accumulation, each rank and each micro-batch computes part of the global batch.
A number drawn there from torch's generators (`torch.randn` in a task's `training_loss`, nn.Dropout, timm's drop
path, a VAE's `randn_like`) is drawn per rank and per micro-batch: the run is valid, but it trains other numbers than
one process does, and the replica check cannot see it (the ranks' copies stay equal). hydraloop.keyed_random's draws
(and KeyedDropout's masks) do not draw from a generator and are exact.

The watch sees such draws without slowing the run: torch's CPU generator is compared with its state after the step's
seeding (hydraloop.seeding.StepSeeder), a GPU's by its Philox offset, about 6 us a pass. The run's first pass, and
the one after a draw was first seen, run under a function mode that records what drew and from where (the first
frame outside torch), so the line names it. Whether any rank drew travels with the reductions the loop makes anyway
(the logged losses', validation's): rank 0 says it once, for every rank.
"""

import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from hydraloop.parallel.single import SingleDevice

log = logging.getLogger("hydraloop.trainer")

# torch's functions and tensor methods that draw from a generator, by name (a function mode sees them by name).
# fmt: off
RANDOM_FUNCTIONS = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
    "multinomial", "poisson", "binomial", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "native_dropout", "rrelu", "rrelu_", "gumbel_softmax", "normal_", "uniform_",
    "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
})
# fmt: on
_TORCH = str(Path(torch.__file__).parent)
_HERE = __file__


class DrawWatch:
    def __init__(self, devices: list[torch.device], split: str | None, main_process: bool, name_draws: bool) -> None:
        """`split`: how this run splits the batch ("2 ranks", "grad_accum_steps=3"), None where it does not (the
        watch then does nothing); `main_process`: the rank that says the line; `name_draws`: whether a pass may run
        under a function mode to name what drew (not under torch.compile, which a mode would make recompile)."""
        self.split, self.main_process = split, main_process
        self.generators = [torch.default_generator] + [
            torch.cuda.default_generators[device.index] for device in devices if device.type == "cuda"
        ]
        self.name_next = name_draws  # the run's first pass is named
        self.name_draws = name_draws
        self.drew_at: int | None = None  # the first step at which this rank drew
        self.names: list[str] = []
        self.said = False

    @contextmanager
    def watching(self, step: int | None) -> Iterator[None]:
        """Around a training pass of step `step` (after its seeding), or a validation batch (None)."""
        if self.split is None or self.said:
            yield
            return
        before = self._states()
        naming = _Naming() if self.name_next else nullcontext()
        with naming:
            yield
        if self.name_next:
            self.name_next = False
            self.names = self.names or getattr(naming, "calls", [])
        if self.drew_at is None and not _equal(self._states(), before):
            self.drew_at = -1 if step is None else step
            self.name_next = self.name_draws and not self.names

    def flag(self) -> float:
        """1.0 if this rank drew and no line has said so yet: a term of the loop's next reduction."""
        return float(self.drew_at is not None and not self.said)

    def reduced(self, ranks_that_drew: float) -> None:
        """After a reduction of `flag()` over the ranks: the line, once, from the main process."""
        if ranks_that_drew < 1 or self.said:
            return
        self.said = True
        if not self.main_process:
            return
        seen = ""
        if self.drew_at is not None:
            where = "in validation" if self.drew_at == -1 else f"at step {self.drew_at}"
            seen = f"; rank 0 first {where}" + (f": {'; '.join(self.names)}" if self.names else "")
        log.warning(
            "this run is not exact: %d rank(s) drew from torch's default generator while the batch is split (%s)%s. "
            "Such numbers depend on the rank and the micro-batch, so the run will not equal single-process training;"
            " draw per-sample numbers with hydraloop.keyed_random, dropout with KeyedDropout (docs/exactness.md)",
            int(ranks_that_drew),
            self.split,
            seen,
        )

    def _states(self) -> list:
        return [g.get_offset() if g.device.type == "cuda" else g.get_state() for g in self.generators]


def split_of(strategy: "SingleDevice", grad_accum_steps: int) -> str | None:
    """How a pass's batch is split (ranks, DataParallel's devices, micro-batches), for the watch's line; None: one
    process computes it whole."""
    parts = [
        f"{strategy.world_size} ranks" if strategy.world_size > 1 else "",
        f"{len(strategy.devices)} devices" if len(strategy.devices) > 1 else "",
        f"grad_accum_steps={grad_accum_steps}" if grad_accum_steps > 1 else "",
    ]
    return ", ".join(part for part in parts if part) or None


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


class _Naming(TorchFunctionMode):
    """Records the first few random functions called, each with the first frame outside torch that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in RANDOM_FUNCTIONS and len(self.calls) < 3:
            frame = next(
                (f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith((_TORCH, _HERE))),
                None,
            )
            where = f" at {_short(frame.filename)}:{frame.lineno} ({frame.name})" if frame else ""
            call = f"torch.{name}{where}"
            if call not in self.calls:
                self.calls.append(call)
        return func(*args, **(kwargs or {}))


def _short(filename: str) -> str:
    """A path as the reader knows it: from the working directory, or from its site-packages."""
    path = Path(filename)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        parts = path.parts
        return str(Path(*parts[parts.index("site-packages") + 1 :])) if "site-packages" in parts else filename
