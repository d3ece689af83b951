"""What model=hf and data=hf share of Hugging Face: its libraries, imported offline (a missing one is one line naming
the `hf` extra), the names that can only be local paths, and the tokenizer a folder, cache entry or tokenizer.json
holds.
"""

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from hydraloop.errors import ConfigError, require

# What a folder save_pretrained wrote a tokenizer to holds: a fast tokenizer's file, or a slow one's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def import_transformers() -> Any:
    """The transformers module, or one line naming the extra that installs it."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "model=hf: needs the transformers package, which is not installed; pip install 'hydraloop[hf]'"
        )
    import transformers

    transformers.logging.set_verbosity_error()  # its notes on fresh heads: hf_model logs its own, in one line
    transformers.logging.disable_progress_bar()  # bars for reading and writing weights, in every log
    return transformers


def import_datasets() -> Any:
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError("data=hf: needs datasets, which is not installed; pip install 'hydraloop[hf]'")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a name not in the cache is an error, never a download
    import datasets

    datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def is_local_path(name: str) -> bool:
    """A name that can only be a path, never a Hugging Face repo id (`gpt2`, `org/name`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str, pad_token: str | None = None) -> Any:
    """The transformers tokenizer in a folder or cache entry `spec`, or in a tokenizer.json; with `pad_token` as its
    padding token. One without one is one line, saying how to set it."""
    transformers = import_transformers()
    require(
        Path(spec).exists() or not is_local_path(spec),
        f"data.dataset.tokenizer={spec}: no such folder or file (data=hf's default is model.name_or_path)",
    )
    # transformers builds an empty tokenizer for a model folder without tokenizer files, silently
    require(
        not Path(spec).is_dir() or any((Path(spec) / name).is_file() for name in TOKENIZER_FILES),
        f"data.dataset.tokenizer={spec}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); give a folder "
        "that holds one (tokenizer.save_pretrained writes it), or a tokenizer.json",
    )
    try:
        if spec.endswith(".json"):
            require(Path(spec).is_file(), f"data.dataset.tokenizer={spec}: no such file")
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=spec)
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"data.dataset.tokenizer={spec}: no tokenizer there ({str(error).strip().splitlines()[0]}); give a folder "
            "save_pretrained wrote, a name in the Hugging Face cache, or a tokenizer.json"
        ) from None
    if pad_token is not None:
        token_id = tokenizer.convert_tokens_to_ids(pad_token)
        require(
            token_id is not None and (token_id != tokenizer.unk_token_id or pad_token == tokenizer.unk_token),
            f"data.dataset.pad_token={pad_token}: not a token of {spec}'s vocabulary",
        )
        tokenizer.pad_token = pad_token
    require(
        tokenizer.pad_token_id is not None,
        f"data.dataset.tokenizer={spec}: has no padding token; set one of its tokens as data.dataset.pad_token "
        f"(e.g. its end-of-text token{' ' + repr(tokenizer.eos_token) if tokenizer.eos_token else ''})",
    )
    return tokenizer
