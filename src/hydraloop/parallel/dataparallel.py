import logging

import torch
from torch import nn

from hydraloop.parallel.single import SingleDevice

log = logging.getLogger(__name__)


class DataParallelStrategy(SingleDevice):
    """One process; nn.DataParallel scatters each batch over several GPUs and gathers the outputs on the first.

    The loop still sees one process with the whole global batch, so sampling and metrics are those of `single`.
    """

    def __init__(self, device: str = "auto", device_ids: list[int] | None = None) -> None:
        super().__init__(device)
        self.device_ids = list(device_ids) if device_ids is not None else None

    def setup(self) -> None:
        super().setup()
        if self.device.type != "cuda":
            self.device_ids = []
        elif self.device_ids is None:
            self.device_ids = list(range(torch.cuda.device_count()))
        elif self.device_ids:
            self.device = torch.device("cuda", self.device_ids[0])  # DataParallel gathers on the first id
            torch.cuda.set_device(self.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)
        if len(self.device_ids) < 2:
            log.warning(
                "parallel=dataparallel needs at least 2 GPUs, found %d: training like parallel=single",
                len(self.device_ids),
            )
            return model
        return nn.DataParallel(model, device_ids=self.device_ids)
