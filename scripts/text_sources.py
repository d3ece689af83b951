"""The text scripts/prepare_text.py reads: a file (or a .gz of one), or a folder of .txt files, checked, and read in
batches of whole lines."""

import gzip
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from hydraloop.errors import ConfigError

BATCH_BYTES = 1 << 20  # lines read and encoded together


def sources(source: Path) -> list[Path]:
    files = sorted(source.rglob("*.txt")) if source.is_dir() else [source]
    if not source.exists():
        raise ConfigError(f"SOURCE {source}: no such file or folder")
    if not files:
        raise ConfigError(f"SOURCE {source}: a folder without .txt files")
    if not sum(file.stat().st_size for file in files):
        raise ConfigError(f"SOURCE {source}: empty")
    return files


def opened(file: Path, binary: bool):
    """A source to read: a `.gz` file decompressed as it is read (the bundled complete works are one)."""
    if file.suffix == ".gz":
        return gzip.open(file, "rb") if binary else gzip.open(file, "rt", encoding="utf-8", newline="")
    return file.open("rb") if binary else file.open(encoding="utf-8", newline="")


def source_bytes(file: Path) -> int:
    """A source's size as read: a gzip file's own record of its uncompressed size (modulo 2**32)."""
    if file.suffix != ".gz":
        return file.stat().st_size
    with file.open("rb") as raw:
        raw.seek(-4, os.SEEK_END)
        return int.from_bytes(raw.read(4), "little")


def line_batches(files: list[Path], progress: tqdm | None = None, binary: bool = False) -> Iterator[list]:
    """The sources in batches of whole lines, about BATCH_BYTES each, a file's own: text, or with `binary` the bytes
    as they are (--tokenizer byte reads any file)."""
    for file in files:
        with opened(file, binary) as lines:
            batch, size = [], 0
            try:
                for line in lines:
                    batch.append(line)
                    size += len(line)
                    if size >= BATCH_BYTES:
                        yield batch
                        if progress is not None:
                            progress.update(size)
                        batch, size = [], 0
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"SOURCE {file}: not UTF-8 text ({error.reason}); --tokenizer byte reads any file"
                ) from None
            except (EOFError, gzip.BadGzipFile, zlib.error) as error:  # a .gz cut short, or not gzip at all
                raise ConfigError(f"SOURCE {file}: not a whole gzip file ({error})") from None
            if batch:
                yield batch
                if progress is not None:
                    progress.update(size)
