"""LoRA adapters on a model=hf model, through peft (the `peft` extra): `model.lora={r: 8, alpha: 16, dropout: 0.1}`.

peft's `get_peft_model` freezes the model and adds, beside each targeted layer, two small trainable matrices whose
product (scaled by alpha / r) is added to the layer's output. Only those, and the modules peft keeps a trainable copy
of (`modules_to_save`: a classifier's fresh head), require gradients; hydraloop's optimizers take only parameters
that require gradients (hydraloop.optim), so the frozen weights have no optimizer state and never move.

LoRA's dropout is an nn.Dropout inside each adapted layer: model=hf's keyed dropout replaces it as it does the
model's own (hydraloop.models.hf_keyed_dropout), each with a key of its own, so that single-process training, ddp,
fsdp and accumulation train the same adapters.

The checkpoint holds the whole wrapped model (its keys are peft's: `base_model.model.<the model's key>`, the adapters'
`...lora_A.default.weight`), so a resume, mode=eval, mode=predict and trainer.eval_best read it as any other.
"""

import difflib
import importlib.util
import warnings
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from hydraloop.errors import ConfigError, first_line, require

# model.lora's keys: what each becomes in peft's LoraConfig.
KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "target_modules",
    "modules_to_save": "modules_to_save",
}
# peft's task types for the auto classes it has a model class for; it then knows their heads (a sequence
# classifier's `score` or `classifier`, trained in full) and their forward arguments. Other classes: peft's PeftModel.
TASK_TYPES = {
    "AutoModelForCausalLM": "CAUSAL_LM",
    "AutoModelForSequenceClassification": "SEQ_CLS",
    "AutoModelForTokenClassification": "TOKEN_CLS",
    "AutoModelForQuestionAnswering": "QUESTION_ANS",
    "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
}
# The layers LoRA adapts, by class name: torch's Linear, Conv2d and Embedding, and transformers' Conv1D (GPT-2's
# Linear, its weight transposed).
ADAPTABLE = ("Linear", "Conv1D", "Conv2d", "Embedding")


def import_peft() -> Any:
    """The peft module, or one line naming the extra that installs it."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora: needs peft, which is not installed; pip install 'hydraloop[peft]'")
    import peft

    return peft


def add_lora(model: nn.Module, lora: Mapping[str, Any], auto_class: str) -> nn.Module:
    """`model` frozen, with LoRA adapters as `lora` (model.lora's node) configures them: peft's model around it."""
    settings = checked_settings(lora)
    peft = import_peft()
    config = peft.LoraConfig(task_type=TASK_TYPES.get(auto_class), **settings)
    try:
        with warnings.catch_warnings():
            # peft adapts GPT-2's Conv1D as it must (its weight transposed), and reads a property transformers
            # deprecates: two warnings in every rank that ask nothing of the user.
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
            return peft.get_peft_model(model, config)
    except ValueError as error:  # peft's NoMatchingPeftModuleError is one: a target that names no layer
        targets = settings.get("target_modules")
        names = adaptable_names(model)
        closest = difflib.get_close_matches(str((targets or [""])[0]), names, n=3, cutoff=0.5)
        raise ConfigError(
            f"model.lora.target_modules={targets if targets is not None else 'null'}: peft cannot adapt "
            f"{type(model).__name__}: {first_line(error)} (its layers LoRA can adapt are named "
            f"{', '.join(closest or names[:8])}{' ...' if not closest and len(names) > 8 else ''})"
        ) from None


def checked_settings(lora: Mapping[str, Any]) -> dict[str, Any]:
    """peft's LoraConfig arguments from model.lora's node, each value checked: bad input in one line."""
    node = OmegaConf.to_container(lora) if OmegaConf.is_config(lora) else lora
    require(
        isinstance(node, Mapping),
        f"model.lora={node}: must be a mapping of {', '.join(KEYS)} (e.g. {{r: 8, alpha: 16}}), or null",
    )
    for key in node:
        if key not in KEYS:
            closest = difflib.get_close_matches(str(key), KEYS, n=1)
            raise ConfigError(
                f"model.lora.{key}: not a LoRA setting{f' (did you mean {closest[0]}?)' if closest else ''}; "
                f"the settings are {', '.join(KEYS)}"
            )
    r, alpha, dropout = node.get("r", 8), node.get("alpha", 8), node.get("dropout", 0.0)
    require(isinstance(r, int) and not isinstance(r, bool) and r > 0, f"model.lora.r={r}: must be a positive integer")
    require(_number(alpha) and alpha > 0, f"model.lora.alpha={alpha}: must be a positive number")
    require(_number(dropout) and 0 <= dropout < 1, f"model.lora.dropout={dropout}: must be in [0, 1)")
    for key in ("target_modules", "modules_to_save"):
        names = node.get(key)
        require(
            names is None or isinstance(names, list) and all(isinstance(name, str) and name for name in names),
            f"model.lora.{key}={names}: must be a list of module names (e.g. [c_attn]), or null",
        )
    return {KEYS[key]: value for key, value in node.items() if value is not None}


def adaptable_names(model: nn.Module) -> list[str]:
    """The last part of the name of each layer of `model` that LoRA can adapt, each once, in the model's order."""
    names = (name.rsplit(".", 1)[-1] for name, module in model.named_modules() if type(module).__name__ in ADAPTABLE)
    return list(dict.fromkeys(names))


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside peft's wrapper (`model` itself where there is none)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
