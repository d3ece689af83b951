"""Batch norm over the global batch (`parallel.sync_batchnorm=true`): every rank normalises with the statistics of
all ranks' samples, as one process normalises with its whole batch. A model with batch norm then trains under ddp
or fsdp to single-process training's numbers.

On CUDA this is torch.nn.SyncBatchNorm (torchvision's reference scripts and Lightning offer the same switch). It
refuses CPU tensors, so on the CPU (gloo) hydraloop's GlobalBatchNorm below takes its place: the same statistics and
gradients, from one all-reduce per layer and forward pass.
"""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import Tensor, nn


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` with each BatchNorm1d/2d/3d replaced by one that normalises over all ranks' samples (its parameters and
    running statistics carried over, so the state_dict keys stay the same)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert(model)


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        converted = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine)
        converted.track_running_stats = module.track_running_stats
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, _convert(child))
    return module


class GlobalBatchNorm(nn.BatchNorm1d):
    """Batch norm whose training statistics are those of the global batch (see the module docstring); any input
    shape (N, C, ...). Outside a process group, or in evaluation, it is plain batch norm."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        per_channel = input.transpose(0, 1).reshape(self.num_features, -1)  # (C, rows x positions)
        values = per_channel.shape[1]
        # This rank's count, mean and squared deviations from it, in its row of a table every rank fills: the
        # statistics of the union then combine exactly (Chan et al.'s pairwise formula), without float32's
        # E[x^2] - E[x]^2 cancellation. A rank with no rows here adds a row of zeros.
        local_mean = per_channel.sum(dim=1) / max(values, 1)
        local_m2 = ((per_channel - local_mean[:, None]) ** 2).sum(dim=1)
        table = input.new_zeros(dist.get_world_size(), 2 * self.num_features + 1)
        table[dist.get_rank()] = torch.cat([local_mean.new_full((1,), values), local_mean, local_m2])
        table = dist_autograd.all_reduce(table)  # differentiable: each rank's statistics reach every rank's loss
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + self.num_features], table[:, 1 + self.num_features :]
        total = counts.sum()
        if float(total) == 0:  # no rank holds a row of this micro-batch
            return input
        mean = (counts * means).sum(dim=0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(dim=0)
        var = m2 / total
        if self.track_running_stats:
            with torch.no_grad():
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked + 1)
                self.num_batches_tracked.add_(1)
                unbiased = m2 / (total - 1) if total > 1 else var
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(unbiased.detach(), momentum)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        normalised = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised
