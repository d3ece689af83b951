"""Any torchvision classification model by name: `model=torchvision model.arch=resnet50`.

Built by torchvision.models.get_model with `num_classes` from the data. Named weights (`model.weights=DEFAULT`,
`IMAGENET1K_V1`, or `ResNet50_Weights.IMAGENET1K_V2`) are read from the torch hub cache
($TORCH_HOME/hub/checkpoints, ~/.cache/torch/hub/checkpoints by default) and never downloaded at run time: a missing
file is bad input, named in one line. With a num_classes other than the weights' (1000 for ImageNet), the classifier
keeps its fresh initialisation and everything else is loaded: fine-tuning. torchvision is imported only here.
"""

import difflib
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from hydraloop.errors import ConfigError

log = logging.getLogger(__name__)


def torchvision_model(arch: str, num_classes: int, weights: str | None = None, **kwargs: Any) -> nn.Module:
    """`torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)`, with `weights` from the hub cache."""
    from torchvision import models

    names = models.list_models(module=models)  # classification only: not detection, segmentation, video
    if arch not in names:
        closest = difflib.get_close_matches(arch, names, n=3, cutoff=0.4)
        suggestion = f"closest: {', '.join(closest)}" if closest else f"e.g. {', '.join(names[:3])}"
        raise ConfigError(f"model.arch={arch}: not a torchvision classification model; {suggestion}")
    if weights is None:
        return models.get_model(arch, num_classes=num_classes, **kwargs)
    name = str(weights)
    cached = _cached_weights(arch, name)
    if torch.get_default_device().type == "meta":  # the launcher's check (arguments.check_model): found is enough
        return models.get_model(arch, num_classes=num_classes, **kwargs)
    pretrained = models.get_model(arch, weights=cached, **kwargs)  # torchvision's own loading, from the cache
    if len(cached.meta["categories"]) == num_classes:
        return pretrained
    model = models.get_model(arch, num_classes=num_classes, **kwargs)
    state, own = pretrained.state_dict(), model.state_dict()
    fresh = [key for key, tensor in state.items() if own[key].shape != tensor.shape]
    model.load_state_dict({key: tensor for key, tensor in state.items() if key not in fresh}, strict=False)
    log.info("model.weights=%s: loaded all but %s, which num_classes=%d resizes", name, ", ".join(fresh), num_classes)
    return model


def _cached_weights(arch: str, name: str) -> Any:
    """The WeightsEnum member `name` names, once its file is known to be in the hub cache."""
    from torchvision import models

    choices = models.get_model_weights(arch)
    try:
        weights = choices.verify(name)
    except (KeyError, ValueError):
        known = ", ".join(["DEFAULT", *choices.__members__])
        raise ConfigError(f"model.weights={name}: {arch} has no such weights; it has {known}") from None
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    if not path.is_file():
        raise ConfigError(
            f"model.weights={name}: expected {path} (hydraloop never downloads at run time; where there is a "
            f"network, `torchvision.models.get_model('{arch}', weights='{name}')` puts the file in its hub cache: "
            "copy it there, or point TORCH_HOME at a folder whose hub/checkpoints holds it)"
        )
    return weights
