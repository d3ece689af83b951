"""torch.profiler over a few steps, written where TensorBoard's profiler view (torch-tb-profiler) reads it."""

from pathlib import Path

import torch


class NullProfiler:
    def __enter__(self) -> "NullProfiler":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def step(self) -> None:
        pass


def step_profiler(trace_dir: str | Path) -> torch.profiler.profile:
    """Skips step 1 (start-up), warms up on step 2, records steps 3-5, then stops recording."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
        record_shapes=True,
        with_stack=False,
    )
