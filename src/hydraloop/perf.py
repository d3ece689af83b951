"""Efficiency metrics of a logging interval: samples and tokens per second, step time, the share of time spent
waiting for data, GPU memory, and model FLOPs utilisation (MFU)."""

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# One GPU's peak dense bf16 TFLOP/s from the vendors' data sheets (torchtitan's table, plus a few). Matched in order
# against torch.cuda.get_device_name, so the more specific names come first.
PEAK_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),  # float16: V100 has no bf16
    ("MI300X", 1300.0),
    ("MI325X", 1300.0),
    ("MI250X", 191.5),
)


def peak_flops(device: torch.device, peak_tflops: float | None) -> float | None:
    """One GPU's peak FLOP/s: `trainer.peak_tflops`, else the table's figure for this GPU; None on the CPU or for a
    GPU the table does not know (then perf/mfu is not logged)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for known, tflops in PEAK_TFLOPS:
        if known in name:
            return tflops * 1e12
    log.info("perf/mfu is not logged: the peak of a %s is not in hydraloop.perf; set trainer.peak_tflops", name)
    return None


def flops_per_sample(model: nn.Module, tokens_per_sample: int | None) -> float | None:
    """Training FLOPs for one sample, from a model that can say its FLOPs per token (as hydraloop's GPT does:
    6N plus attention); None for others."""
    per_token = getattr(model, "flops_per_token", None)
    if per_token is None or tokens_per_sample is None:
        return None
    return per_token(tokens_per_sample) * tokens_per_sample


class Throughput:
    """Turns an interval's steps, samples and seconds into the perf/ metrics (global: counted over all ranks)."""

    def __init__(
        self,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        gpus: int = 1,
    ) -> None:
        self.tokens_per_sample = tokens_per_sample
        # Model FLOPs over what all the job's GPUs could do in the same time.
        self.flops_per_sample_over_peak = (
            flops_per_sample / (peak_flops * gpus) if flops_per_sample is not None and peak_flops else None
        )

    def metrics(self, steps: int, samples: int, seconds: float, data_wait_s: float) -> dict[str, float]:
        """`samples`: the global batches' rows over the `steps` (fewer than steps x batch size for an incomplete
        last batch)."""
        samples_per_sec = samples / seconds
        metrics = {
            "train/samples_per_sec": samples_per_sec,
            "perf/samples_per_sec": samples_per_sec,
            "perf/step_time_ms": 1000 * seconds / steps,
            "perf/data_wait_frac": data_wait_s / seconds,
        }
        if self.tokens_per_sample is not None:
            metrics["perf/tokens_per_sec"] = samples_per_sec * self.tokens_per_sample
        if self.flops_per_sample_over_peak is not None:
            metrics["perf/mfu"] = samples_per_sec * self.flops_per_sample_over_peak
        return metrics


def interval_peak_memory_gb(devices: list[torch.device]) -> float:
    """The most memory allocated on any of this rank's GPUs since the last call (then the peak is reset): the peak of
    one logging interval, not of the whole process."""
    peak = max(torch.cuda.max_memory_allocated(device) for device in devices)
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return peak / 1e9
