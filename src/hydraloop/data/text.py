"""Next-token prediction on any text file: `data=text`, character-level (default) or byte-level tokens.

The vocabulary is part of the config, so it is known before any rank reads data (the launcher builds the model from
the config) and it is saved wherever the resolved config is (train.log, TensorBoard's `config` text, every
checkpoint's `config`): sampling and evaluation decode as training encoded. `data.vocab` is filled in by the
`text_vocab` resolver (registered in hydraloop.config):

- char level: the file's distinct characters, sorted by code point, as one string; token i is `vocab[i]`.
- byte level: null; token i is the byte i of the file (256 tokens, any file, UTF-8 or not).

A sample is a pair (x, y) of `block_size` tokens, y being x shifted by one: x = tokens[i : i + T], y =
tokens[i + 1 : i + T + 1]. Train takes the first 1 - val_fraction of the tokens and val the rest (split by position,
so no sample of one straddles the other), each cut at a fixed stride, so an epoch is a fixed, finite data set that
DistributedSampler shards exactly.
"""

import functools
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from hydraloop.errors import ConfigError

LEVELS = ("char", "byte")
BYTE_VOCAB_SIZE = 256
DEFAULT_CORPUS = "shakespeare.txt"
"""Used when data.dataset.path is null: three Shakespeare plays, see corpora/README.md."""


def corpus_path(path: str | None) -> Path:
    """`path` as given (relative to the directory the run starts from: Hydra's chdir is off), or the bundled corpus."""
    if path is None:
        return Path(str(resources.files("hydraloop.data") / "corpora" / DEFAULT_CORPUS))
    return Path(str(path))


def read_text(path: str | None, level: str) -> str | bytes:
    """The file's text (char level, decoded as UTF-8) or its bytes (byte level)."""
    where = f"data.dataset.path={path}"
    if level not in LEVELS:
        raise ConfigError(f"data.dataset.level={level}: must be one of {', '.join(LEVELS)}")
    file = corpus_path(path)
    if not file.is_file():
        problem = "a directory, not a file" if file.is_dir() else "no such file"
        raise ConfigError(f"{where}: {problem} ({file.resolve()})")
    data = file.read_bytes()
    if not data:
        raise ConfigError(f"{where}: the file is empty")
    if level == "byte":
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "data.dataset.level=byte reads any file"
        ) from None


def text_vocab(path: str | None, level: str) -> str | None:
    """The `text_vocab` resolver: the sorted distinct characters of the file (char level), or null (byte level)."""
    file = corpus_path(path)
    # The launcher resolves the config more than once, and each time would read the whole file: cached, as long as
    # the file is unchanged (a sweep's jobs run in one process).
    stamp = (file.stat().st_mtime_ns, file.stat().st_size) if file.is_file() else None
    return _text_vocab(path, level, stamp)


@functools.lru_cache(maxsize=16)
def _text_vocab(path: str | None, level: str, stamp: tuple[int, int] | None) -> str | None:
    text = read_text(path, level)
    if level == "byte":
        return None
    vocab = "".join(sorted(set(text)))
    if "${" in vocab:  # a resolved config is re-created by OmegaConf, which would read this as an interpolation
        raise ConfigError(
            f"data.dataset.path={path}: its characters, sorted, contain '${{' (no letters or digits between them), "
            "which OmegaConf cannot hold as data.vocab; use data.dataset.level=byte"
        )
    return vocab


def vocab_size(vocab: str | None) -> int:
    """The `text_vocab_size` resolver: the number of tokens of a vocabulary (null: bytes, 256)."""
    return BYTE_VOCAB_SIZE if vocab is None else len(vocab)


def encode(text: str | bytes, vocab: str | None, where: str = "text") -> Tensor:
    """Token ids (int64) of `text`: its characters' positions in `vocab`, or its UTF-8 bytes when vocab is None.

    A character outside the vocabulary is a ConfigError naming `where`, the character and its position.
    """
    if vocab is None:
        # surrogateescape: a command-line argument that was not UTF-8 comes back as its own bytes
        data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    if not isinstance(text, str):
        raise TypeError("encode: a character vocabulary encodes str, not bytes")
    if not vocab or len(set(vocab)) != len(vocab):
        raise ConfigError(f"data.vocab={vocab!r}: must be distinct characters, at least one")
    # Vectorised over code points: a lookup per character in Python would take seconds per 10 MB.
    code_points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    vocab_points = np.frombuffer(vocab.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    order = np.argsort(vocab_points)
    slots = np.searchsorted(vocab_points, code_points, sorter=order).clip(max=len(vocab) - 1)
    ids = order[slots]
    unknown = np.flatnonzero(vocab_points[ids] != code_points)
    if unknown.size:
        first = int(unknown[0])
        others = len(set(text) - set(vocab)) - 1
        more = f" (and {others} other character{'s' * (others > 1)})" if others > 0 else ""
        raise ConfigError(
            f"{where}: character {text[first]!r} at position {first} is not in the vocabulary "
            f"of {len(vocab)} characters{more}"
        )
    return torch.from_numpy(ids.astype(np.int64))


def decode(tokens: Sequence[int] | Tensor, vocab: str | None) -> str:
    """Text of token ids. Byte level: invalid UTF-8 (a sampled byte sequence may be) becomes U+FFFD."""
    ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    if vocab is None:
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(vocab[i] for i in ids)


def load_text(
    block_size: int,
    vocab: str | None,
    path: str | None = None,
    level: str = "char",
    val_fraction: float = 0.1,
    stride: int | None = None,
) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) TensorDatasets of (x, y) int64 pairs of `block_size` tokens, y = x shifted by one token.

    vocab: data.vocab (the text_vocab resolver's, or one given), None at byte level. stride: tokens between the
    starts of two samples; None: block_size (non-overlapping samples).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"data.block_size={block_size}: must be a positive integer")
    stride = block_size if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
        raise ConfigError(f"data.dataset.stride={stride}: must be a positive integer")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be between 0 and 1 (exclusive)")
    text = read_text(path, level)
    if level == "byte" and vocab is not None:
        raise ConfigError(f"data.vocab={vocab!r}: must be null at data.dataset.level=byte (the 256 bytes)")
    if level == "char" and vocab is None:
        raise ConfigError("data.vocab=None: data.dataset.level=char needs a vocabulary string")
    tokens = encode(text, vocab, where=f"data.dataset.path={path}")
    num_train = int(len(tokens) * (1 - val_fraction))
    splits = {"train": tokens[:num_train], "val": tokens[num_train:]}
    for name, split in splits.items():
        if len(split) < block_size + 1:
            raise ConfigError(
                f"data.block_size={block_size}: the {name} split of data.dataset.path={path} has {len(split)} "
                f"tokens (data.dataset.val_fraction={val_fraction} of {len(tokens)}), fewer than the "
                f"block_size + 1 = {block_size + 1} one sample needs"
            )
    return _samples(splits["train"], block_size, stride), _samples(splits["val"], block_size, stride)


def _samples(tokens: Tensor, block_size: int, stride: int) -> TensorDataset:
    windows = tokens.unfold(0, block_size + 1, stride)  # (count, block_size + 1), starts 0, stride, 2 * stride, ...
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def unigram_entropy(tokens: Tensor) -> float:
    """Entropy in nats of the tokens' frequencies: the loss of the best model that ignores context, which a
    language model should end well below."""
    counts = torch.bincount(tokens.flatten()).double()
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * probabilities.log()).sum()) if probabilities.numel() else math.nan
