"""Any timm model by name: `model=timm model.name=convnext_tiny` (the `timm` extra).

Built by `timm.create_model` with `num_classes` from the data. `pretrained=true` reads the weights timm would
download (its pretrained config's Hugging Face repo) from the Hugging Face cache ($HF_HOME/hub), or from
`weights_file`: never downloaded at run time, and missing weights are one line saying which file was expected where.
With a num_classes other than the weights' (1000 for ImageNet), timm keeps the classifier fresh and loads the rest.

`keyed_dropout=true` (the default) makes the model's randomness keyed (hydraloop.keyed_dropout), so that ddp, fsdp
and accumulation train what one process trains: its nn.Dropout layers (drop_rate, proj_drop_rate, attn_drop_rate)
become KeyedDropout, its DropPath layers (drop_path_rate: stochastic depth) KeyedDropPath, its functional dropout
calls are keyed by their order, and attention with dropout is computed explicitly (timm's fused attention would draw
its masks in the kernel).

timm's own data config for a name (input size, mean, std, interpolation, crop fraction) is available to the config
as `${timm_data:NAME,KEY}`, e.g. a Normalize with `mean: ${timm_data:${model.name},mean}`.
"""

import difflib
import importlib.util
from pathlib import Path
from typing import Any

from torch import nn

from hydraloop.errors import ConfigError, first_line
from hydraloop.keyed_dropout import KeyedDropPath
from hydraloop.models.hf_keyed_dropout import use_keyed_dropout

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a Hugging Face repo, in that order


def timm_model(
    name: str,
    num_classes: int,
    pretrained: bool = False,
    weights_file: str | None = None,
    keyed_dropout: bool = True,
    **kwargs: Any,
) -> nn.Module:
    """`timm.create_model(name, num_classes=num_classes, **kwargs)`, pretrained weights from the cache or a file;
    its randomness keyed unless `keyed_dropout=false`."""
    model = _timm_model(name, num_classes, pretrained, weights_file, **kwargs)
    if keyed_dropout:
        key_timm_randomness(model)
    return model


def key_timm_randomness(model: nn.Module) -> None:
    """A timm model's dropout, drop path and attention dropout, keyed (see the module's docstring)."""
    from timm.layers import DropPath

    for module in model.modules():
        attention_dropout = getattr(module, "attn_drop", None)
        if getattr(module, "fused_attn", False) and isinstance(attention_dropout, nn.Dropout) and attention_dropout.p:
            module.fused_attn = False  # its explicit path applies attn_drop, keyed below
    use_keyed_dropout(model)
    paths = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, DropPath):
                paths += 1
                setattr(module, name, KeyedDropPath(child.drop_prob, key=paths))


def _timm_model(name: str, num_classes: int, pretrained: bool, weights_file: str | None, **kwargs: Any) -> nn.Module:
    timm = import_timm()
    architecture = timm.models.split_model_name_tag(name)[0]
    if not timm.is_model(architecture):
        closest = difflib.get_close_matches(architecture, timm.list_models(), n=3, cutoff=0.5)
        hint = f"closest: {', '.join(closest)}" if closest else "timm.list_models() names them"
        raise ConfigError(f"model.name={name}: not a timm model; {hint}")
    tag = timm.models.split_model_name_tag(name)[1]
    if tag:
        tagged = timm.list_pretrained(f"{architecture}.*")
        if name not in tagged:
            closest = difflib.get_close_matches(name, tagged, n=3, cutoff=0.5)
            hint = f"closest: {', '.join(closest)}" if closest else f"{architecture} has {', '.join(tagged) or 'none'}"
            raise ConfigError(f"model.name={name}: timm has no weights tagged {tag!r}; {hint}")
    if not pretrained and weights_file is None:
        return _created(timm, name, num_classes=num_classes, **kwargs)
    path = Path(weights_file) if weights_file is not None else _cached_weights(timm, name)
    if not path.is_file():
        raise ConfigError(f"model.weights_file={weights_file}: no such file")
    overlay = {"file": str(path)}
    return _created(timm, name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes, **kwargs)


def _created(timm: Any, name: str, **kwargs: Any) -> nn.Module:
    """timm.create_model; a keyword the architecture does not take (model.drop_rat=...) is one line."""
    try:
        return timm.create_model(name, **kwargs)
    except TypeError as error:
        if "keyword argument" not in str(error):
            raise
        raise ConfigError(
            f"model.name={name}: {first_line(error)} (the model's keys but name, pretrained and weights_file go to "
            "timm.create_model)"
        ) from None


def import_timm() -> Any:
    """The timm module, or one line naming the extra that installs it."""
    if importlib.util.find_spec("timm") is None:
        raise ConfigError("model=timm: needs timm, which is not installed; pip install 'hydraloop[timm]'")
    import timm

    return timm


def _cached_weights(timm: Any, name: str) -> Path:
    """The file of `name`'s pretrained weights in the Hugging Face cache, or one line saying what to fetch."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    config = timm.get_pretrained_cfg(name)
    repo = getattr(config, "hf_hub_id", None)
    if not repo:
        raise ConfigError(f"model.pretrained=true: timm has no pretrained weights for {name}; give model.weights_file")
    for filename in WEIGHT_FILES:
        found = try_to_load_from_cache(repo, filename)
        if isinstance(found, str):
            return Path(found)
    raise ConfigError(
        f"model.pretrained=true: {name}'s weights ({repo}, {WEIGHT_FILES[0]}) are not in the Hugging Face cache "
        f"({HF_HUB_CACHE}); hydraloop never downloads at run time: where there is a network, `hf download {repo}` "
        "fills that cache (copy it here, or point HF_HOME at a copy), or give the file as model.weights_file"
    )


def timm_data(name: str, key: str) -> Any:
    """`${timm_data:NAME,KEY}`: a value of timm's pretrained data config for `name` (mean, std, input_size,
    interpolation, crop_pct, crop_mode), as a list where it is a tuple."""
    timm = import_timm()
    config = timm.get_pretrained_cfg(name)
    if config is None:
        raise ConfigError(f"timm_data:{name}: timm has no pretrained config for {name}")
    values = config.to_dict()
    if key not in values:
        raise ConfigError(f"timm_data:{name},{key}: no such key; it has {', '.join(sorted(values))}")
    value = values[key]
    return list(value) if isinstance(value, tuple) else value
