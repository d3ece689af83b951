"""`data=hf`: a labelled text data set read with Hugging Face `datasets` and tokenized with the model's tokenizer
(the `hf` extra), for sequence classification:

    python src/train.py data=hf data.dataset.path=reviews.csv data.num_classes=2 model=hf \
        model.auto_class=AutoModelForSequenceClassification model.name_or_path=path/to/pretrained

`path` is a local file (csv, json or jsonl, parquet, txt), a folder `save_to_disk` wrote, or a data set already in
the Hugging Face cache (read offline: never downloaded). Its splits give train and validation (`train_split`,
`val_split`), or a fixed `val_fraction` of the train split is held out by `split_seed`. Each sample's text (and an
optional second text: pairs) is tokenized with `tokenizer` (a folder or cache name holding one, or a tokenizer.json)
through `datasets.map` in batches, truncated to `max_length` (data.block_size, checked against the model's
positions), and kept in hydraloop's data cache under a key of the source's fingerprint, the tokenizer's contents and
these settings: a changed tokenizer or setting never reads a stale cache. Batches are padded to their own longest
sample, with an attention mask: `{"input_ids", "attention_mask", "labels"}`, which the task passes to the model by
keyword. Labels are integers in [0, num_classes), or names (sorted, numbered from 0).
"""

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hydraloop.data.cache import cached_arrays, default_cache_dir
from hydraloop.errors import ConfigError, first_line, require
from hydraloop.huggingface import import_datasets, load_tokenizer
from hydraloop.tasks.language_model import IGNORED

FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class TokenizedTexts(Dataset):
    """Token ids of varying length (flat, with offsets) and a label per sample, or (labels None) next-token targets:
    each position's next token, IGNORED at the last; `collate_fn` pads a batch."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray | None, pad_id: int) -> None:
        self.ids, self.offsets, self.labels, self.pad_id = ids, offsets, labels, pad_id

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.ids[self.offsets[index] : self.offsets[index + 1]].astype(np.int64))
        if self.labels is None:
            return {"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([IGNORED])])}
        return {"input_ids": ids, "labels": torch.tensor(int(self.labels[index]))}

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The samples padded (on the right) to the longest of them, with the attention mask that hides the padding;
        next-token targets padded with IGNORED."""
        longest = max((len(sample["input_ids"]) for sample in samples), default=0)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = sample["input_ids"]
            mask[row, : len(sample["input_ids"])] = 1
        if self.labels is None:
            labels = torch.full((len(samples), longest), IGNORED, dtype=torch.int64)
            for row, sample in enumerate(samples):
                labels[row, : len(sample["labels"])] = sample["labels"]
        else:
            labels = torch.stack([sample["labels"] for sample in samples])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def load_hf_dataset(
    path: str,
    tokenizer: str | None,
    num_classes: int | None,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str | None = "label",
    max_length: int = 128,
    pad_token: str | None = None,
    train_split: str = "train",
    val_split: str | None = "validation",
    val_fraction: float = 0.1,
    split_seed: int = 0,
    cache_dir: str | None = None,
) -> tuple[TokenizedTexts, TokenizedTexts]:
    """(train, val) of the data set at `path`, tokenized by `tokenizer` (see the module docstring); without a
    `label_column`, for next-token prediction (data=hf_lm)."""
    require(tokenizer is not None, "data.dataset.tokenizer=null: give a folder or cache name holding one, or a .json")
    require(max_length > 0, f"data.block_size={max_length}: must be positive")
    splits = _read_splits(path, Path(cache_dir) if cache_dir else default_cache_dir())
    require(
        train_split in splits,
        f"data.dataset.train_split={train_split}: {path} has the splits {', '.join(splits)}",
    )
    train = splits[train_split]
    if val_split is not None and val_split in splits:
        val = splits[val_split]
    else:
        require(0 < val_fraction < 1, f"data.dataset.val_fraction={val_fraction}: must be between 0 and 1")
        halves = train.train_test_split(test_size=val_fraction, seed=split_seed, shuffle=True)
        train, val = halves["train"], halves["test"]
    columns = {"text_column": text_column, "label_column": label_column, "text_pair_column": text_pair_column}
    for key, column in columns.items():
        require(
            column is None or column in train.column_names,
            f"data.dataset.{key}={column}: {path} has no such column; it has {', '.join(train.column_names)}",
        )
    _check_no_empty_cells(train, val, columns, path)
    label_ids = _label_ids(train, val, label_column, num_classes) if label_column else None
    hf_tokenizer = load_tokenizer(tokenizer, pad_token)
    settings = [tokenizer_digest(hf_tokenizer), text_column, text_pair_column, label_column, max_length]
    parts = []
    for name, split in (("train", train), ("val", val)):
        key = hashlib.sha256(json.dumps([split._fingerprint, *settings]).encode()).hexdigest()[:24]
        arrays = cached_arrays(
            f"hf_{key}",
            functools.partial(_tokenized, split, hf_tokenizer, columns, max_length, label_ids),
            cache_dir,
        )
        labels = arrays["labels"] if label_column else None
        require(len(arrays["offsets"]) > 1, f"data.dataset.path={path}: the {name} split has no samples")
        parts.append(TokenizedTexts(arrays["ids"], arrays["offsets"], labels, hf_tokenizer.pad_token_id))
    return parts[0], parts[1]


def _read_splits(path: str, cache: Path) -> dict[str, Any]:
    """The data set's splits; a file's Arrow conversion goes into hydraloop's data cache, beside the tokenized ones."""
    datasets = import_datasets()
    local = Path(path)
    verbosity = datasets.logging.get_verbosity()
    # datasets logs a file it cannot parse at ERROR (twice: its handler, and the root's) before raising: the one line
    # below says it.
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        if local.is_dir():
            loaded = datasets.load_from_disk(str(local))
        elif local.suffix in FILE_BUILDERS:
            require(local.is_file(), f"data.dataset.path={path}: no such file")
            files = {"train": str(local)}
            loaded = datasets.load_dataset(FILE_BUILDERS[local.suffix], data_files=files, cache_dir=str(cache / "hf"))
        else:
            loaded = datasets.load_dataset(path)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001  datasets' many kinds of "cannot read it", as one line
        # "An error occurred while generating the dataset": the parser's own words are its cause's.
        cause = error.__cause__ if isinstance(error, datasets.exceptions.DatasetGenerationError) else None
        reason = first_line(cause or error)
        raise ConfigError(
            f"data.dataset.path={path}: cannot be read as a data set ({reason}); give a csv, json, jsonl, parquet or "
            "txt file, a folder save_to_disk wrote, or a name already in the Hugging Face cache (never downloaded)"
        ) from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def _check_no_empty_cells(train: Any, val: Any, columns: dict[str, str | None], path: str) -> None:
    """An empty cell (null) in a column read: the tokenizer cannot take it, and a label cannot be one."""
    for key, column in columns.items():
        if column is None:
            continue
        # Arrow counts them: reading the column into Python took 0.1 s per 4000 rows, in the launcher and each rank.
        empty = sum(split.with_format("arrow")[column].null_count for split in (train, val))
        require(
            empty == 0,
            f"data.dataset.{key}={column}: {path} has {empty} empty cell(s) there; fill or drop those rows",
        )


def _label_ids(train: Any, val: Any, column: str, num_classes: int) -> dict[Any, int] | None:
    """A name-to-id map for labels that are names; None for integer labels, checked to lie in [0, num_classes)."""
    names = getattr(train.features[column], "names", None)  # a ClassLabel's
    if names is not None:
        require(
            len(names) == num_classes,
            f"data.num_classes={num_classes}: the data set's {column} has {len(names)} classes ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''})",
        )
        return None
    values = set(train.unique(column)) | set(val.unique(column))
    if all(isinstance(value, (int, np.integer)) and not isinstance(value, bool) for value in values):
        low, high = min(values), max(values)
        require(
            low >= 0 and high < num_classes,
            f"data.num_classes={num_classes}: the labels in {column} run from {low} to {high}",
        )
        return None
    require(
        all(isinstance(value, str) for value in values),
        f"data.dataset.label_column={column}: holds {sorted(map(repr, values))[:3]}...: integers or names, not both",
    )
    require(
        len(values) == num_classes,
        f"data.num_classes={num_classes}: {column} holds {len(values)} names ({', '.join(sorted(values)[:5])}...)",
    )
    return {name: index for index, name in enumerate(sorted(values))}


def _tokenized(
    split: Any, tokenizer: Any, columns: dict[str, str | None], max_length: int, label_ids: dict | None
) -> dict[str, np.ndarray]:
    text, label, pair = columns["text_column"], columns["label_column"], columns["text_pair_column"]

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = (batch[text], batch[pair]) if pair else (batch[text],)
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        if label is None:
            labels = [0] * len(encoded["input_ids"])  # next-token targets come from the ids themselves
        else:
            labels = [label_ids[value] for value in batch[label]] if label_ids else batch[label]
        return {"input_ids": encoded["input_ids"], "labels": labels}

    tokenized = split.map(encode, batched=True, remove_columns=split.column_names, keep_in_memory=True)
    ids = tokenized["input_ids"]
    lengths = np.array([len(row) for row in ids], dtype=np.int64)
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    flat = np.fromiter((token for row in ids for token in row), dtype=dtype, count=int(lengths.sum()))
    return {"ids": flat, "offsets": np.concatenate([[0], np.cumsum(lengths)]), "labels": np.array(tokenized["labels"])}


def tokenizer_size(spec: str | None, pad_token: str | None = None) -> int:
    """The `hf_vocab_size` resolver: the tokens of the tokenizer `spec` (data=hf_lm's data.vocab_size)."""
    require(spec is not None, "data.dataset.tokenizer=null: give a folder or cache name holding one, or a .json")
    return len(load_tokenizer(spec, pad_token))


def tokenizer_digest(tokenizer: Any) -> str:
    """What tells tokenizers apart: the whole of a fast tokenizer's definition, and its padding token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    contents = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{contents}\0{tokenizer.pad_token}".encode()).hexdigest()
