"""`data=tokens`: next-token prediction on pre-tokenized files, read through `np.memmap` (nanoGPT's format).

A prepared folder (scripts/prepare_text.py writes one) holds `train.bin` and `val.bin`, each a flat array of token
ids (`uint16`, or `uint32` for vocabularies over 65,535), and `meta.json`: the dtype, the vocabulary size and the
tokenizer that made them. Nothing is read into memory: a sample is `block_size + 1` tokens copied out of the mapped
file when it is asked for, so memory stays flat in the corpus size (the pages the OS caches are its own).

Training windows are one of:
- random (the default, as nanoGPT samples): window k of an epoch starts at an offset drawn from (seed, epoch, k)
  alone, by a counter-based hash, not a generator's stream. The global sample order is hydraloop's
  (GlobalBatchSampler), so ddp, fsdp, accumulation and a resume at any step see the windows single-process training
  sees. An epoch is `samples_per_epoch` windows (null: as many as cover the split once, tokens / block_size).
- strided: every window at a fixed stride, an epoch being one pass, as data=text cuts them.

Validation takes the whole val split at stride block_size, or with `val_windows=N` a fixed set of N windows drawn
from `seed` alone: the same windows whatever the world size, a cheap estimate that does not change between runs.
"""

import contextlib
import functools
import json
import mmap
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hydraloop.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SPLITS = ("train", "val")
META = "meta.json"
NANOGPT_META = "meta.pkl"
CHECKED_CHUNKS = 16  # spread over each file: the ids the launcher reads to check them against the vocabulary
CHUNK_TOKENS = 1 << 16


def read_meta(folder: str | Path) -> dict[str, Any]:
    """`meta.json` of a prepared folder, checked: dtype, vocabulary size, both splits' files and their sizes."""
    where = f"data.dataset.dir={folder}"
    path = Path(str(folder)) / META
    if not Path(str(folder)).is_dir():
        raise ConfigError(f"{where}: no such folder (prepare one: python scripts/prepare_text.py <text> <folder>)")
    if not path.is_file() and (Path(str(folder)) / NANOGPT_META).is_file():
        path = Path(str(folder)) / NANOGPT_META  # a folder of nanoGPT's own prepare.py
    if not path.is_file():
        raise ConfigError(
            f"{where}: no {META} (a folder prepared by scripts/prepare_text.py has one; nanoGPT's char-level "
            f"prepare.py writes {NANOGPT_META}, also read)"
        )
    stamp = path.stat().st_mtime_ns
    return _read_meta(str(folder), path.name, stamp)


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, strings and numbers only: a pickle that names any class or function (which unpickling would run) is
    refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _nanogpt_meta(folder: str) -> dict[str, Any]:
    """nanoGPT's meta.pkl ({vocab_size, itos, stoi} of a character vocabulary; ids in uint16) as meta.json's form."""
    where = f"data.dataset.dir={folder}"
    try:
        with open(Path(folder) / NANOGPT_META, "rb") as file:
            meta = _PlainUnpickler(file).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ConfigError(f"{where}: {NANOGPT_META} is not a plain pickle of a vocabulary ({error})") from None
    itos, size = (meta.get("itos"), meta.get("vocab_size")) if isinstance(meta, dict) else (None, None)
    chars = [itos.get(i) for i in range(size)] if isinstance(itos, dict) and type(size) is int else []
    if not chars or not all(isinstance(char, str) and len(char) == 1 for char in chars):
        raise ConfigError(f"{where}: {NANOGPT_META} holds no character vocabulary (vocab_size and itos, as nanoGPT's)")
    return {"dtype": "uint16", "vocab_size": size, "tokenizer": {"kind": "char", "vocab": "".join(chars)}}


@functools.lru_cache(maxsize=16)
def _read_meta(folder: str, name: str, stamp: int) -> dict[str, Any]:
    where = f"data.dataset.dir={folder}"
    if name == META:
        try:
            meta = json.loads((Path(folder) / META).read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{where}: {META} is not readable JSON ({type(error).__name__})") from None
    else:
        meta = _nanogpt_meta(folder)
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: {META} holds {type(meta).__name__}, not an object of dtype, vocab_size, tokenizer")
    dtype, vocab_size, tokenizer = meta.get("dtype"), meta.get("vocab_size"), meta.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("kind"), str):
        raise ConfigError(f"{where}: {META} has tokenizer={tokenizer!r}; must be an object with a kind (char, ...)")
    named = tokenizer.get("file")  # a BPE's or Hugging Face tokenizer, which sampling and exports decode with
    if named is not None and not (Path(folder) / str(named)).is_file():
        raise ConfigError(f"{where}: {META} names the tokenizer {named}, which is not there (prepare the folder again)")
    if not isinstance(meta.get("tokens", {}), dict):
        raise ConfigError(f"{where}: {META} has tokens={meta['tokens']!r}; must be an object of train and val counts")
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: {META} has dtype={dtype!r}; must be one of {', '.join(DTYPES)}")
    if type(vocab_size) is not int or not 0 < vocab_size <= np.iinfo(DTYPES[dtype]).max + 1:
        raise ConfigError(f"{where}: {META} has vocab_size={vocab_size!r}, which {dtype} ids cannot number")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    for split in SPLITS:
        file = Path(folder) / f"{split}.bin"
        if not file.is_file():
            raise ConfigError(f"{where}: no {split}.bin")
        size = file.stat().st_size
        if size % itemsize:
            raise ConfigError(f"{where}: {split}.bin has {size} bytes, not a whole number of {dtype} tokens")
        counted = meta.get("tokens", {}).get(split)
        if counted is not None and counted != size // itemsize:
            raise ConfigError(
                f"{where}: {split}.bin holds {size // itemsize} tokens, {META} says {counted}: not the files it "
                "describes (prepare the folder again)"
            )
    return meta


def token_meta(folder: str, key: str) -> Any:
    """The `token_meta` resolver: a key of the folder's meta.json (vocab_size, tokenizer)."""
    return read_meta(folder).get(key)


class TokenFile:
    """One split's tokens, mapped on first use in each process: a DataLoader worker maps its own (a pickled memmap
    would carry the whole array with it)."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, dtype
        self.length = path.stat().st_size // np.dtype(DTYPES[dtype]).itemsize
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
            # Windows are read at random places (random offsets, or strided ones in a shuffled order): without this
            # hint each page fault reads ahead and maps megabytes around it, which a window never uses.
            with contextlib.suppress(AttributeError, OSError):  # no madvise on this platform
                self._tokens._mmap.madvise(mmap.MADV_RANDOM)
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


class Windows(Dataset):
    """Samples (x, y) of `block_size` tokens from a token file, y = x shifted by one, starting at `start(key)`."""

    def __init__(self, file: TokenFile, block_size: int, vocab_size: int, where: str) -> None:
        self.file, self.block_size, self.vocab_size, self.where = file, block_size, vocab_size, where

    def start(self, key: Any) -> int:
        raise NotImplementedError

    def __getitem__(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.start(key)
        ids = self.file.tokens[start : start + self.block_size + 1]
        # Every window is checked as it is read (the max of a few hundred ids): an id the launcher's sampled check
        # missed still ends the run in one line, naming where it is.
        if ids.max() >= self.vocab_size:
            offset = start + int(np.flatnonzero(ids >= self.vocab_size)[0])
            raise ConfigError(
                f"{self.where}: token id {int(self.file.tokens[offset])} at position {offset} of "
                f"{self.file.path.name} is not below vocab_size={self.vocab_size}"
            )
        window = torch.from_numpy(ids.astype(np.int64))
        return window[:-1], window[1:]


class StridedWindows(Windows):
    """Every window at `stride`: window i starts at i * stride."""

    def __init__(self, file: TokenFile, block_size: int, vocab_size: int, where: str, stride: int) -> None:
        super().__init__(file, block_size, vocab_size, where)
        self.stride = stride

    def __len__(self) -> int:
        return (self.file.length - self.block_size - 1) // self.stride + 1

    def start(self, key: Any) -> int:
        return (key[1] if isinstance(key, tuple) else key) * self.stride


class RandomWindows(Windows):
    """`count` windows an epoch at offsets drawn from (seed, epoch, index) alone. The training sampler yields
    (epoch, index) keys (keyed_by_epoch): a worker process never sees set_epoch."""

    keyed_by_epoch = True
    draws_its_own_order = True  # a permutation of the indices would add nothing but its memory (8 bytes a window)

    def __init__(self, file: TokenFile, block_size: int, vocab_size: int, where: str, count: int, seed: int) -> None:
        super().__init__(file, block_size, vocab_size, where)
        self.count, self.seed = count, seed
        self.offsets = file.length - block_size  # starts 0 .. length - block_size - 1: a full window each

    def __len__(self) -> int:
        return self.count

    def start(self, key: Any) -> int:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        return int(mix64(_epoch_base(self.seed, epoch) + index) % np.uint64(self.offsets))


@functools.lru_cache(maxsize=64)
def _epoch_base(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)[0])


def mix64(value: int) -> np.uint64:
    """SplitMix64's finaliser: neighbouring counters give unrelated, uniform 64-bit values."""
    with np.errstate(over="ignore"):
        z = np.uint64(value % (1 << 64)) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def check_ids(file: TokenFile, vocab_size: int, where: str) -> None:
    """The launcher's check of the ids: CHECKED_CHUNKS runs of CHUNK_TOKENS ids spread evenly over the file (the
    first and last included), not the whole corpus; every window is checked again as it is read (Windows)."""
    length = file.length
    starts = np.linspace(0, max(0, length - CHUNK_TOKENS), num=min(CHECKED_CHUNKS, max(1, length)), dtype=np.int64)
    for start in sorted(set(starts.tolist())):
        chunk = file.tokens[start : start + CHUNK_TOKENS]
        if chunk.size and int(chunk.max()) >= vocab_size:
            offset = start + int(np.flatnonzero(chunk >= vocab_size)[0])
            raise ConfigError(
                f"{where}: token id {int(chunk[offset - start])} at position {offset} of {file.path.name} is not "
                f"below vocab_size={vocab_size} (meta.json)"
            )


def load_tokens(
    dir: str,
    block_size: int,
    windows: str = "random",
    stride: int | None = None,
    samples_per_epoch: int | None = None,
    val_windows: int | None = None,
    seed: int = 0,
) -> tuple[Windows, Windows]:
    """(train, val) data sets of (x, y) int64 pairs of `block_size` tokens from a prepared folder (see the module
    docstring). `stride`: between strided windows' starts (null: block_size)."""
    where = f"data.dataset.dir={dir}"
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"data.block_size={block_size}: must be a positive integer")
    if windows not in ("random", "strided"):
        raise ConfigError(f"data.dataset.windows={windows}: must be random or strided")
    stride = block_size if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
        raise ConfigError(f"data.dataset.stride={stride}: must be a positive integer")
    for key, value in (("samples_per_epoch", samples_per_epoch), ("val_windows", val_windows)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"data.dataset.{key}={value}: must be a positive integer, or null")
    meta = read_meta(dir)
    vocab_size = meta["vocab_size"]
    files = {split: TokenFile(Path(dir) / f"{split}.bin", meta["dtype"]) for split in SPLITS}
    for split, file in files.items():
        if file.length < block_size + 1:
            raise ConfigError(
                f"data.block_size={block_size}: {split}.bin of {where} has {file.length} tokens, fewer than the "
                f"block_size + 1 = {block_size + 1} one sample needs"
            )
        check_ids(file, vocab_size, where)
    train_file, val_file = files["train"], files["val"]
    if windows == "strided":
        train = StridedWindows(train_file, block_size, vocab_size, where, stride)
    else:
        count = samples_per_epoch or max(1, train_file.length // block_size)
        train = RandomWindows(train_file, block_size, vocab_size, where, count, seed)
    if val_windows is None:
        val = StridedWindows(val_file, block_size, vocab_size, where, block_size)
    else:  # drawn with replacement: more draws than windows would repeat them, at any cost (a typo's 10**12 hangs)
        if val_windows > val_file.length - block_size:
            raise ConfigError(
                f"data.dataset.val_windows={val_windows}: more than the {val_file.length - block_size} windows val.bin "
                f"of {where} holds; null validates on all of it (every window at stride block_size)"
            )
        val = FixedWindows(val_file, block_size, vocab_size, where, val_windows, seed)
    return train, val


class FixedWindows(RandomWindows):
    """`count` windows drawn once from the seed: the same set in every validation, under any world size."""

    keyed_by_epoch = draws_its_own_order = False
    DRAW = 2**31 - 1  # the "epoch" of this draw: one training never reaches

    def start(self, key: Any) -> int:
        return int(mix64(_epoch_base(self.seed, self.DRAW) + key) % np.uint64(self.offsets))
