"""Does a run compute what a single-process run computes? Two finished runs compared entry by entry: their final
checkpoints and the metrics they wrote (read by hydraloop.final_state).

Four parts, each by name and in order: the model's parameters and buffers; the optimizers' state, their parameter
groups and schedules; the callbacks' state (EMA's average); the metrics. An entry's difference is `max|a - b|` over
the scale of its kind: a tensor's over the largest value of every tensor of its part (a parameter: of all parameters
and buffers; EMA's average likewise), an optimizer state's over the largest of that state (every `exp_avg`, every
`exp_avg_sq`: Adam's second moments are ~1e-8), a number's over itself. Not each tensor over its own largest value: a
parameter whose true gradient is zero (an attention key's bias: softmax ignores it) moves by round-off alone, which
Adam's normalised step turns into steps of any size up to lr, so its values are noise, and noise relative to itself
is O(1). An entry that one run has and the other lacks, or that differs in a value that is not a number, is an
infinite difference.

scripts/check_exact.py runs a user's command under every strategy and prints `table`; tests/test_matrix.py crosses
the features in a covering array. `StopAfterStep` is the stop signal their stop-then-resume rows send.
"""

from __future__ import annotations

import fnmatch
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hydraloop.callbacks import Callback, TrainerView
from hydraloop.final_state import FinalState, final_state

if TYPE_CHECKING:
    from hydraloop.checkpoint import TrainState

PARTS = ("parameters", "optimizer", "callbacks", "metrics")

# Relative to the scale of the entry's kind (`kind`). float32: the same sums in another order (ranks' and
# micro-batches' mean gradients added where one process takes one mean) differ by a few ulps (6e-8 each); Adam's
# normalised step turns the round-off of a gradient that sums to nearly zero into a step of up to lr, so 5 steps end
# 1e-7..9e-6 apart (measured: experiment=digits_mlp 8.5e-6, the matrix's tiny GPT, GPT-2 and OPT below 2e-6). A
# rank-dependent bug differs by the size of the update itself: 1e-2 and up (tests/faults.py's RankDependentMLP:
# 9.6e-2). bf16 autocast rounds each matmul's output to 8 bits, so another batch split rounds other sums: 4e-3..8e-3
# apart after 5 steps, single against single with accumulation too. fp16 (11 bits): in between, not measured here.
TOLERANCES = {"32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}

# A metric's difference is over max(|a|, |b|, METRIC_FLOOR): a loss of 4 relatively, an accuracy or a learning rate
# absolutely, so that one prediction of bf16 that flips at a near tie (1/384 of val/acc 0.1) is not 2.5% of it.
METRIC_FLOOR = 1.0


class StopAfterStep(Callback):
    """Sends this process a stop signal (SIGTERM, as SLURM or torchrun would) after optimizer step `step`: the run
    checkpoints where the ranks next meet (every step with trainer.log_every_n_steps=1) and exits 143, and the same
    command continues it. `+callbacks.stop._target_=hydraloop.exactness.StopAfterStep +callbacks.stop.step=3`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, trainer: TrainerView, state: TrainState) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def difference(a: Any, b: Any, scale: float | None = None) -> float:
    """`max|a - b| / scale` for numbers and tensors, `scale` by default `max(max|a|, max|b|)` (0 where they are
    equal, NaN at the same places included); 0 or infinity for anything else, equal or not."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return math.inf
        a, b = a.detach().double(), b.detach().double()
        if not torch.equal(a.isnan(), b.isnan()):
            return math.inf
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        largest = (a - b).abs().max().item() if a.numel() else 0.0
        scale = _magnitude(a, b) if scale is None else scale
        return 0.0 if largest == 0 else largest / scale if scale else math.inf
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return difference(torch.tensor(float(a)), torch.tensor(float(b)), scale)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return max((difference(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else math.inf


def _magnitude(*tensors: torch.Tensor) -> float:
    return max((t.detach().double().nan_to_num(0.0).abs().max().item() for t in tensors if t.numel()), default=0.0)


def _number_scale(a: Any, b: Any, floor: float) -> float | None:
    """max(|a|, |b|, floor) for two numbers; None (each value's own) for anything else."""
    numbers = [abs(v) for v in (a, b) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return max(*numbers, floor) if len(numbers) == 2 and floor else None


def kind(name: str) -> str:
    """What a tensor's scale is measured over: an optimizer's state per key (`exp_avg[head.weight]`: every
    exp_avg), anything else over its whole part (a parameter: every parameter and buffer)."""
    return name.split("[", 1)[0] if "[" in name else ""


@dataclass
class PartDifference:
    """One part's largest difference (None: neither run has the part), and its first entry beyond the tolerance."""

    largest: float | None = None
    first: str | None = None
    first_value: float = 0.0


@dataclass
class Comparison:
    parts: dict[str, PartDifference] = field(default_factory=dict)
    tolerance: float = TOLERANCES["32"]

    @property
    def passed(self) -> bool:
        return all(part.first is None for part in self.parts.values())

    @property
    def first(self) -> str | None:
        """The first entry beyond the tolerance, parameters first: `parameters: head.weight (3.2e-02)`."""
        for name, part in self.parts.items():
            if part.first is not None:
                shown = "missing in one run" if part.first_value == math.inf else f"{part.first_value:.1e}"
                return f"{name}: {part.first} ({shown})"
        return None


def compare(reference: FinalState, other: FinalState, tolerance: float, may_lack: tuple[str, ...] = ()) -> Comparison:
    """Each part of `other` against `reference`'s (`compare_entries`). `may_lack`: patterns (fnmatch) of
    `part/name` that `other` may lack: a reference run with callbacks=[ema] and trainer.eval_best=true serves runs
    without them, whose training is its own (`("callbacks/*", "metrics/*ema/*", "metrics/best/*")`)."""
    parts = {}
    for part in PARTS:
        lacking = partial(_matches, prefix=f"{part}/", patterns=may_lack)
        floor = METRIC_FLOOR if part == "metrics" else 0.0
        parts[part] = compare_entries(reference.parts[part], other.parts[part], tolerance, lacking, floor)
    return Comparison(parts, tolerance)


def _matches(name: str, prefix: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(prefix + name, pattern) for pattern in patterns)


def compare_entries(
    ours: dict[str, Any],
    theirs: dict[str, Any],
    tolerance: float,
    may_lack: Callable[[str], bool] = lambda name: False,
    floor: float = 0.0,
) -> PartDifference:
    """Entry by entry, in `ours`' order, then `theirs`' extra ones; an entry only one side has is an infinite
    difference, but for one of `ours` that `may_lack` excuses. A number's scale is at least `floor`."""
    result = PartDifference()
    scales: dict[str, float] = {}
    for name, value in [*ours.items(), *theirs.items()]:
        if isinstance(value, torch.Tensor):
            scales[kind(name)] = max(scales.get(kind(name), 0.0), _magnitude(value))
    names = [name for name in ours if name in theirs or not may_lack(name)]
    for name in [*names, *(name for name in theirs if name not in ours)]:
        if isinstance(ours.get(name), torch.Tensor):
            scale = scales.get(kind(name))
        else:
            scale = _number_scale(ours.get(name), theirs.get(name), floor)
        value = difference(ours[name], theirs[name], scale) if name in ours and name in theirs else math.inf
        result.largest = max(result.largest or 0.0, value)
        if value > tolerance and result.first is None:
            result.first, result.first_value = name, value
    return result


def compare_runs(
    reference_dir: str | Path, run_dir: str | Path, tolerance: float, may_lack: tuple[str, ...] = ()
) -> Comparison:
    return compare(final_state(reference_dir), final_state(run_dir), tolerance, may_lack)


@dataclass
class Outcome:
    """A row that has no comparison: `refused` (exit 2: hydraloop does not run that combination) or `failed` (a
    crash, a timeout), with its one line."""

    result: str
    text: str


def likely_cause(log: str) -> str:
    """What a failing row's run log says of why it left single-process training: per-rank draws the run saw
    (hydraloop.draw_watch), nn.Dropout the launcher saw, or the causes no run can see."""
    for line in log.splitlines():
        if "this run is not exact:" in line:
            seen = line.split("while the batch is split", 1)[-1].split(". Such numbers", 1)[0]
            return f"cause: draws from torch's generator per rank and micro-batch{seen.split(')', 1)[-1]}"
        if "the model has nn.Dropout" in line:
            return "cause: nn.Dropout, whose masks depend on the split (KeyedDropout's do not)"
    return (
        "cause: no per-rank draw was seen in the passes; the run depends on how the batch is split in another way: "
        "a data set drawing from torch's generator per sample (wrap it in SeededAugmentation), batch statistics "
        "(batch norm without parallel.sync_batchnorm), a loss over the whole batch not declared as one "
        "(hydraloop.tasks.global_batch), code that reads its rank, or bf16 round-off beyond the tolerance"
    )


def table(rows: list[tuple[str, Comparison | Outcome | None]]) -> str:
    """Plain text: per row its parts' largest differences, pass or fail, and the first entry beyond the tolerance;
    an Outcome's line in place of them, and None for the reference."""
    header = ["row", *PARTS, "result", "first beyond tolerance"]
    lines = []
    for label, outcome in rows:
        if outcome is None:
            lines.append([label, *("-" for _ in PARTS), "reference", ""])
        elif isinstance(outcome, Outcome):
            lines.append([label, *("" for _ in PARTS), outcome.result.upper(), outcome.text])
        else:
            shown = [_shown(outcome.parts[part].largest) for part in PARTS]
            lines.append([label, *shown, "pass" if outcome.passed else "FAIL", outcome.first or ""])
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(line, widths)), line[-1]]).rstrip()
        for line in [header, *lines]
    )


def _shown(value: float | None) -> str:
    if value is None:
        return "-"
    if value == math.inf:
        return "inf"
    return "0" if value == 0 else f"{value:.1e}"
