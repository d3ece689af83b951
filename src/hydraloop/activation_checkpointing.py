"""`trainer.activation_checkpointing`: chosen modules keep only their inputs in the forward pass and recompute their
activations in the backward pass. Memory for activations then grows with the number of such modules, not with their
depth inside; each costs one more forward.

Applied through PyTorch's composable `checkpoint` (hooks; the module tree, its names and its checkpoint keys stay as
they are), before a strategy wraps the model, under every strategy: FSDP gathers a unit's parameters again for its
recomputation, as for its backward. The recomputation draws the dropout masks the forward drew: plain nn.Dropout
through the generator state the checkpoint restores, keyed dropout because the recomputation sees the rows, step and
functional dropout calls the forward saw (row_keys.same_masks_in_recompute: the training loop sets them only
around the forward, and the backward comes later). A Hugging Face model keeps no key/value cache in training
(models/hf.py), which a recomputation would append to a second time.
"""

from typing import Any

from torch import nn
from torch.distributed._composable import checkpoint

from hydraloop.errors import ConfigError
from hydraloop.row_keys import same_masks_in_recompute


def checkpointed_classes(setting: Any, model: nn.Module) -> list[str]:
    """The class names whose modules recompute, from the setting: false or null, none; true, the model's blocks (its
    `_no_split_modules`: hydraloop's GPT and Hugging Face models name theirs); a list, those classes. Each must be
    a class of the model's modules: one line naming the setting and the classes the model has, else."""
    key = f"trainer.activation_checkpointing={str(setting).lower() if isinstance(setting, bool) else setting}"
    if setting is None or setting is False:
        return []
    if setting is True:
        blocks = list(getattr(model, "_no_split_modules", None) or [])
        if not blocks:
            raise ConfigError(
                f"{key}: {type(model).__name__} names no blocks (_no_split_modules); give a list of the module "
                f"classes to recompute, among {', '.join(_classes(model))}"
            )
        return blocks
    if isinstance(setting, str) or not all(isinstance(name, str) for name in setting):
        raise ConfigError(f"{key}: must be true, false or a list of module class names, such as [Block]")
    unmatched = [name for name in setting if name not in _classes(model)]
    if unmatched:
        raise ConfigError(
            f"{key}: {', '.join(unmatched)} is no module class of {type(model).__name__} (it has "
            f"{', '.join(_classes(model))})"
        )
    return list(setting)


def checkpoint_activations(model: nn.Module, classes: list[str]) -> None:
    """Every module of `model` whose class name is in `classes` recomputes its activations in backward; nested ones
    inside an outer such module are left to the outer one."""
    chosen: list[str] = []
    for name, module in model.named_modules():  # pre-order: an outer module comes before what it holds
        if type(module).__name__ in classes and not any(name.startswith(f"{outer}.") for outer in chosen):
            checkpoint(module, context_fn=same_masks_in_recompute)
            chosen.append(name)


def _classes(model: nn.Module) -> list[str]:
    return sorted({type(module).__name__ for module in model.modules()})
