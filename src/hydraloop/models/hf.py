"""A Hugging Face transformers model by Auto class: `model=hf model.name_or_path=FOLDER` (the `hf` extra).

`name_or_path` is a folder written by `save_pretrained`, or a name already in the Hugging Face cache ($HF_HOME/hub):
hydraloop never downloads at run time, and a model that is in neither is one line saying what to fetch where.
`from_config=true` (or `model_type` alone, e.g. `model.model_type=gpt2`) builds the architecture with fresh weights,
with `model.config.*` overriding its config (`+model.config.n_layer=2`: a + adds a key). The model is the
transformers model itself, so checkpoints hold its own keys and the task calls it as Hugging Face documents (input
ids, or a dict batch by keyword), reading `logits` from its output.

Dropout. `keyed_dropout=true` (the default) keys every dropout mask of the model by sample, as hydraloop's own
models do, so that single-process training, ddp and accumulation train the same weights
(hydraloop.models.hf_keyed_dropout). `gradient_checkpointing=true` recomputes with the forward's keys.

LoRA. `lora={r: 8, alpha: 16, dropout: 0.1}` (the `peft` extra) freezes the model and trains LoRA adapters, peft's,
their dropout keyed too (hydraloop.models.hf_lora).

In training the model keeps no cache of keys and values: nothing reads it there, and a block that an activation
checkpoint recomputes (trainer.activation_checkpointing) would append its keys and values to it a second time.
"""

import difflib
import inspect
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hydraloop.errors import ConfigError, first_line, require
from hydraloop.huggingface import import_transformers, is_local_path, load_tokenizer
from hydraloop.models.hf_keyed_dropout import KEYED_ATTENTION, register_keyed_attention, use_keyed_dropout
from hydraloop.models.hf_lora import add_lora, base_model
from hydraloop.row_keys import same_masks_in_recompute

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what from_pretrained reads (either may be sharded)
log = logging.getLogger(__name__)


def hf_model(
    auto_class: str = "AutoModelForCausalLM",
    name_or_path: str | None = None,
    model_type: str | None = None,
    from_config: bool = False,
    config: dict[str, Any] | None = None,
    num_labels: int | None = None,
    vocab_size: int | None = None,
    block_size: int | None = None,
    max_length: int | None = None,
    tokenizer: str | None = None,
    pad_token: str | None = None,
    keyed_dropout: bool = True,
    gradient_checkpointing: bool = False,
    read_weights: bool = True,
    lora: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The transformers model `auto_class` names, from `name_or_path` (its weights) or `model_type` (fresh). With
    fresh weights, `vocab_size` (the data's) sizes the embeddings unless `config` sets it; `num_labels` goes to the
    config of a classifier (an auto class `...ForSequenceClassification`: its head); `block_size` and `max_length`
    (the data's: data=hf truncates its texts to max_length) are checked against the model's positions; `tokenizer`
    (data=hf's) against its vocabulary, and its padding token becomes the config's (a GPT-2 classifier reads each
    row's last token before the padding). `read_weights=False` builds the architecture these settings build, with
    fresh weights and nothing read but `name_or_path`'s config: the model a checkpoint of them holds the weights of
    (from_config would size a pretrained model's embeddings for the data, not as they were trained). `lora`: peft's
    LoRA adapters on the frozen model (hydraloop.models.hf_lora), returned inside peft's wrapper."""
    transformers = import_transformers()
    auto = _auto_class(transformers, auto_class)
    overrides = dict(config or {})
    fresh = from_config or name_or_path is None
    if num_labels is not None and "Classification" in auto_class:
        overrides.setdefault("num_labels", num_labels)
    texts = None
    if tokenizer is not None:
        texts = load_tokenizer(tokenizer, pad_token)
        overrides.setdefault("pad_token_id", texts.pad_token_id)
    if fresh and vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    elif name_or_path is None and texts is not None:  # an architecture alone: embeddings for the tokenizer's tokens
        overrides.setdefault("vocab_size", len(texts))
    model_config = _config(transformers, name_or_path, model_type, overrides)
    _check_sizes(model_config, vocab_size, {"data.block_size": block_size, "data.dataset.max_length": max_length})
    if not fresh and read_weights:
        _check_weights(name_or_path)
    require(
        texts is None or len(texts) <= model_config.vocab_size,
        f"data.dataset.tokenizer={tokenizer}: {len(texts) if texts else 0} tokens, more than the model's vocabulary of "
        f"{model_config.vocab_size}",
    )
    attention = {"attn_implementation": KEYED_ATTENTION} if keyed_dropout else {}
    if keyed_dropout:
        register_keyed_attention()
    # The launcher's check (checks.check_model) runs on the meta device: the architecture is enough, weights unread.
    try:
        if fresh or not read_weights or torch.get_default_device().type == "meta":
            model, loading = auto.from_config(model_config, **attention), {}
        else:
            model, loading = auto.from_pretrained(
                name_or_path,
                config=model_config,
                local_files_only=True,
                ignore_mismatched_sizes=True,
                output_loading_info=True,
                **attention,
            )
    except (TypeError, ValueError, AssertionError) as error:  # a class or settings that do not make a model
        given = ", ".join(f"model.config.{key}={value}" for key, value in (config or {}).items())
        raise ConfigError(
            f"model.auto_class={auto_class}{', ' + given if given else ''}: transformers cannot build the model: "
            f"{first_line(error)}"
        ) from None
    if loading:
        fresh_keys = [*loading.get("missing_keys", []), *(key for key, *_ in loading.get("mismatched_keys", []))]
        if fresh_keys:  # a classifier's new head, say: what transformers' own warning would say
            log.info("model.name_or_path=%s: loaded all but %s, which start fresh", name_or_path, ", ".join(fresh_keys))
    if lora is not None:  # before the keyed dropout, which then keys LoRA's dropout too
        model = add_lora(model, lora, auto_class)
    if keyed_dropout:
        use_keyed_dropout(model)
    take_batches_of_no_rows(model)
    train_without_cache(model)
    if gradient_checkpointing:
        require(
            model.supports_gradient_checkpointing,
            f"model.gradient_checkpointing=true: {type(model).__name__} does not support it",
        )
        # The recomputation runs in the backward pass: it draws the forward's keyed masks only if given its keys.
        recompute = {"use_reentrant": False, "context_fn": same_masks_in_recompute}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=recompute)
    return model


def train_without_cache(model: nn.Module) -> None:
    """In training (with gradients), `model` is called with use_cache=False, as transformers does for its own
    gradient checkpointing: a recomputed block would append its keys and values to the cache a second time."""
    if "use_cache" not in inspect.signature(base_model(model).forward).parameters:  # an encoder, say: it keeps no cache
        return

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False
        return args, kwargs

    model.register_forward_pre_hook(before, with_kwargs=True)


def take_batches_of_no_rows(model: nn.Module) -> None:
    """Lets `model` take a batch of no rows, which the loop hands a rank with no row of an incomplete last batch:
    transformers' models cannot (GPT-2 reshapes its attention mask with a -1). Such a batch runs as one row of ones
    (valid ids, an unmasked position), and the outputs come back with no rows: the rank still runs every layer and
    joins the gradient reduction, with zero gradients."""
    empty: list[bool] = []  # per call (nested calls have their own): did it get a batch of no rows?

    def grown(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == 0:
            return value.new_ones((1, *value.shape[1:]))
        return value

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((v for v in [*args, *kwargs.values()] if isinstance(v, Tensor) and v.dim()), None)
        empty.append(first is not None and first.shape[0] == 0)
        if not empty[-1]:
            return args, kwargs
        return tuple(map(grown, args)), {key: grown(value) for key, value in kwargs.items()}

    def after(module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
        if not empty.pop() or not isinstance(outputs, Mapping):  # a tuple (return_dict=False), or None on an error
            return outputs
        for key, value in outputs.items():
            if isinstance(value, Tensor) and value.dim() and value.shape[0] == 1:
                outputs[key] = value[:0]
        return outputs

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


def _auto_class(transformers: Any, name: str) -> Any:
    if name.startswith("AutoModel") and hasattr(transformers, name):
        return getattr(transformers, name)
    # Listing transformers' lazy module takes 0.3 s: only to name the closest classes to one it does not have.
    names = [key for key in dir(transformers) if key.startswith("AutoModel")]
    if name not in names:
        closest = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        raise ConfigError(
            f"model.auto_class={name}: not a transformers Auto class; "
            + (f"closest: {', '.join(closest)}" if closest else "e.g. AutoModelForCausalLM, AutoModelForMaskedLM")
        )
    return getattr(transformers, name)


def _config(transformers: Any, name_or_path: str | None, model_type: str | None, overrides: dict) -> Any:
    if name_or_path is None:
        require(
            model_type is not None,
            "model.name_or_path=null, model.model_type=null: give a folder or cached name, "
            "or a model_type (e.g. gpt2) to build from a config",
        )
        types = list(transformers.CONFIG_MAPPING.keys())
        if model_type not in types:
            closest = ", ".join(difflib.get_close_matches(model_type, types, n=3, cutoff=0.5)) or "none close"
            raise ConfigError(f"model.model_type={model_type}: not a transformers model type; closest: {closest}")
        return _with_overrides(transformers.AutoConfig.for_model(model_type), overrides)
    if Path(name_or_path).is_dir() and not (Path(name_or_path) / "config.json").is_file():
        raise ConfigError(_not_found(name_or_path))  # transformers' own words blame a config.json that is not there
    try:
        loaded = transformers.AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except OSError:
        raise ConfigError(_not_found(name_or_path)) from None
    except ValueError as error:  # an unknown model_type, say
        raise ConfigError(f"model.name_or_path={name_or_path}: its config.json says: {first_line(error)}") from None
    return _with_overrides(loaded, overrides)


def _with_overrides(config: Any, overrides: dict) -> Any:
    unknown = [
        key for key in overrides if key not in ("num_labels", "vocab_size", "pad_token_id") and not hasattr(config, key)
    ]
    require(
        not unknown,
        f"model.config.{unknown[0] if unknown else ''}: not a setting of {type(config).__name__}",
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _not_found(name_or_path: str) -> str:
    """The one line for a model neither in a local folder nor in the cache, saying what to fetch where."""
    from huggingface_hub.constants import HF_HUB_CACHE

    if Path(name_or_path).exists():
        return f"model.name_or_path={name_or_path}: the folder has no config.json (a folder save_pretrained wrote has)"
    if is_local_path(name_or_path):
        return f"model.name_or_path={name_or_path}: no such folder (a folder save_pretrained wrote, or a cached name)"
    return (
        f"model.name_or_path={name_or_path}: not a local folder, and not in the Hugging Face cache ({HF_HUB_CACHE}); "
        f"hydraloop never downloads at run time: where there is a network, `hf download {name_or_path}` fills that "
        "cache (copy it here, or point HF_HOME at a copy), or save_pretrained writes a folder to give instead"
    )


def _check_weights(name_or_path: str) -> None:
    """A local folder holds weights to load: a config alone would fail in every rank, after the run started."""
    folder = Path(name_or_path)
    if folder.is_dir():
        names = [f"{stem}{suffix}" for stem in WEIGHT_FILES for suffix in ("", ".index.json")]
        require(
            any((folder / name).is_file() for name in names),
            f"model.name_or_path={name_or_path}: the folder has a config.json but no weights ({', '.join(WEIGHT_FILES)}"
            "); model.from_config=true builds its architecture with fresh weights",
        )


def _check_sizes(config: Any, vocab_size: int | None, lengths: dict[str, int | None]) -> None:
    positions = getattr(config, "max_position_embeddings", None)
    for key, length in lengths.items():
        require(
            length is None or positions is None or length <= positions,
            f"{key}={length}: longer than the model's {positions} positions (max_position_embeddings in its config)",
        )
    own_vocab = getattr(config, "vocab_size", None)
    require(
        vocab_size is None or own_vocab is None or vocab_size <= own_vocab,
        f"data.vocab_size={vocab_size}: larger than the model's vocabulary of {own_vocab} (vocab_size in its config)",
    )


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers model (or one inside peft's wrapper): never, where nothing has imported
    transformers."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(base_model(model), transformers.PreTrainedModel)


def generate(
    model: nn.Module, idx: Tensor, max_new_tokens: int, temperature: float, top_k: int, vocab_size: int | None = None
) -> Tensor:
    """scripts/sample.py's options through transformers' `generate`: temperature 0 is greedy, top_k 0 no limit; it
    draws from torch's global generator (seed it first), from the first `vocab_size` ids (the tokenizer's) alone. It
    stops early only at the model's end-of-text token."""
    positions = getattr(model.config, "max_position_embeddings", None)
    require(
        positions is None or idx.shape[1] + max_new_tokens <= positions,
        f"--max-new-tokens={max_new_tokens}: with the prompt's {idx.shape[1]} token(s), more than the model's "
        f"{positions} positions",
    )
    config = model.config
    sampling = {"temperature": temperature, "top_k": top_k} if temperature > 0 else {}
    if vocab_size is not None and vocab_size < config.vocab_size:  # embeddings padded past the tokenizer's ids
        sampling["suppress_tokens"] = list(range(vocab_size, config.vocab_size))
    return model.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else config.eos_token_id,
        **sampling,
    )
