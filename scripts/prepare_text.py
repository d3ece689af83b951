"""Tokenizes a text file, or a folder of them, into the token files data=tokens memory-maps.

    python scripts/prepare_text.py SOURCE OUT [--tokenizer char|byte|bpe|PATH] [--vocab-size 4096]
                                             [--val-fraction 0.1] [--overwrite] [--processes N]

SOURCE: a text file (or a .gz of one), or a folder whose *.txt files (recursively, in sorted order) are read one
after another. The bundled complete works of Shakespeare, src/hydraloop/data/corpora/shakespeare_complete.txt.gz,
are one such file (see that folder's README.md).
OUT gets train.bin and val.bin (flat uint16 token ids, uint32 for vocabularies over 65,535) and meta.json; the last
val_fraction of the tokens is val, as data=text splits. Tokenizers:
- char: the sources' distinct characters in code-point order (data=text's char level: the same ids);
- byte: the UTF-8 bytes, 256 ids, any file;
- bpe: a byte-level BPE of --vocab-size tokens trained here on SOURCE with Hugging Face `tokenizers`, saved as
  OUT/tokenizer.json;
- PATH: a Hugging Face tokenizer, a tokenizer.json or a model folder holding one (GPT-2's, say), never downloaded.
With bpe and PATH each source file's ids are those of its whole text, `tokenizer.encode(text).ids`: the tokens the
tokenizer's post-processor adds (a BOS <s>, BERT's [CLS] and [SEP]) once, at the file's start and end, and a word of
its pre-tokenizer that spans a line break (a byte-level BPE's indent, 'ĊĠĠĠ') as one word (scripts/whole_text.py; its
truncation and padding, if set, do not apply).

It streams: the sources are read a batch of lines at a time and written as they are encoded, so a corpus larger than
memory works; char and byte batches are encoded by --processes worker processes (default: the cores, up to 8), bpe
and Hugging Face tokenizers encode each batch in pieces on every core (the tokenizers library's threads). A
progress bar counts what has been read (characters; bytes for --tokenizer byte), against the sources' size in bytes.
The files are written beside OUT and renamed into place at the end; rerun with the same sources (sizes and
modification times) and settings, it leaves OUT as it is. OUT holding another corpus's token files is refused,
unless --overwrite (which replaces those files, and no others).
"""

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from text_sources import line_batches, source_bytes, sources
from tqdm import tqdm
from whole_text import WholeTextEncoder

from hydraloop.data.text import encode
from hydraloop.errors import ConfigError


class Tokenizer:
    """What meta.json records of a tokenizer, and its encoding of a batch of lines as one array of ids."""

    def __init__(
        self, spec: str, files: list[Path], vocab_size: int | None, out_tmp: Path, special_tokens: list[str] = ()
    ) -> None:
        self.kind = spec if spec in ("char", "byte", "bpe") else "huggingface"
        self.binary = self.kind == "byte"
        if self.kind != "bpe" and vocab_size is not None:
            raise ConfigError(f"--vocab-size {vocab_size}: only for --tokenizer bpe (the others fix their own)")
        if self.kind != "bpe" and special_tokens:
            raise ConfigError(f"--special-tokens {' '.join(special_tokens)}: only for --tokenizer bpe")
        self.vocab = None
        if self.kind == "char":
            self.vocab = "".join(sorted(set().union(*(set("".join(batch)) for batch in line_batches(files)))))
            self.size, self.meta = len(self.vocab), {"kind": "char", "vocab": self.vocab}
        elif self.kind == "byte":
            self.size, self.meta = 256, {"kind": "byte"}
        else:
            self.hf = self._hf_tokenizer(spec, files, vocab_size, list(special_tokens))
            self.hf.save(str(out_tmp / "tokenizer.json"))
            digest = hashlib.sha256((out_tmp / "tokenizer.json").read_bytes()).hexdigest()
            self.size = self.hf.get_vocab_size()
            self.meta = {"kind": self.kind, "file": "tokenizer.json", "sha256": digest}
            self.whole_text = WholeTextEncoder(self.hf)

    @staticmethod
    def _hf_tokenizer(spec: str, files: list[Path], vocab_size: int | None, special_tokens: list[str]):
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise ConfigError(
                f"--tokenizer {spec}: needs the tokenizers package; pip install 'hydraloop[text]'"
            ) from None
        if spec != "bpe":
            path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
            if not path.is_file():
                raise ConfigError(
                    f"--tokenizer {spec}: neither char, byte, bpe nor a tokenizer.json (or a folder holding one)"
                )
            try:
                return HFTokenizer.from_file(str(path))
            except Exception as error:  # noqa: BLE001  the library's own parse error
                raise ConfigError(f"--tokenizer {spec}: not a Hugging Face tokenizer file ({error})") from None
        if vocab_size is None or vocab_size < 257:
            raise ConfigError(
                f"--vocab-size {vocab_size}: --tokenizer bpe needs at least 257 (the 256 bytes, then merges)"
            )
        tokenizer = HFTokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=special_tokens,  # the first ids; never made from text (an end-of-text or padding token)
            show_progress=False,
        )
        tokenizer.train_from_iterator(("".join(batch) for batch in line_batches(files)), trainer=trainer)
        return tokenizer

    def encode(self, batch: list) -> np.ndarray:
        """A batch of characters or bytes (a Hugging Face tokenizer encodes whole files: WholeTextEncoder)."""
        return encode((b"" if self.binary else "").join(batch), self.vocab).numpy()


def encoded(tokenizer: Tokenizer, files: list[Path], progress: tqdm | None, processes: int) -> Iterator[np.ndarray]:
    """The sources' ids, in order. Characters and bytes are encoded by `processes` worker processes, a window of
    batches at a time (memory stays bounded); a Hugging Face tokenizer encodes each file as its whole text."""
    if tokenizer.kind not in ("char", "byte"):
        for file in files:
            yield from tokenizer.whole_text.file_ids(line_batches([file], progress))
        return
    batches = line_batches(files, progress, binary=tokenizer.binary)
    if processes <= 1:
        yield from map(tokenizer.encode, batches)
        return
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        window: list[list] = []
        for batch in batches:
            window.append(batch)
            if len(window) == 2 * processes:
                yield from pool.map(tokenizer.encode, window)
                window = []
        yield from pool.map(tokenizer.encode, window)


def fingerprint(files: list[Path], args) -> dict:
    """What makes OUT what it is: the sources as found, and the settings."""
    stamp = lambda path: [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]  # noqa: E731
    tokenizer = Path(args.tokenizer)
    tokenizer = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    return {
        "sources": [stamp(file) for file in files],
        # A tokenizer file that changed makes other ids: its size and time are part of what OUT was made from.
        "tokenizer": stamp(tokenizer) if tokenizer.is_file() else args.tokenizer,
        "vocab_size": args.vocab_size,
        "val_fraction": args.val_fraction,
        **(
            {"special_tokens": args.special_tokens} if args.special_tokens else {}
        ),  # folders made before it: as they were
    }


def made_from_of(out: Path) -> dict | None:
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("made_from") if isinstance(meta, dict) else None


def is_complete(out: Path, made_from: dict) -> bool:
    """OUT was made from `made_from`, and its token files are all there, as long as meta.json says, with the
    tokenizer file it names."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        sizes = {split: (out / f"{split}.bin").stat().st_size for split in ("train", "val")}
        counted = {split: meta["tokens"][split] * dtype.itemsize for split in ("train", "val")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    tokenizer_file = (meta.get("tokenizer") or {}).get("file")
    if tokenizer_file is not None and not (out / tokenizer_file).is_file():
        return False
    return meta.get("made_from") == made_from and sizes == counted


def prepare(source: Path, out: Path, args) -> str:
    files = sources(source)
    made_from = fingerprint(files, args)
    meta_file = out / "meta.json"
    if meta_file.is_file():
        if is_complete(out, made_from):
            return f"{out}: up to date (the same sources and settings), left as it is"
        if made_from_of(out) != made_from and not args.overwrite:  # the same, incomplete: made again
            raise ConfigError(f"OUT {out}: holds token files of other sources or settings; --overwrite replaces them")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {out}: exists and is not a prepared folder (no meta.json); give an empty or new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's is private; OUT gets a folder's usual mode
    try:
        tokenizer = Tokenizer(args.tokenizer, files, args.vocab_size, tmp, args.special_tokens)
        dtype = np.uint16 if tokenizer.size <= 1 << 16 else np.uint32
        total_bytes = sum(source_bytes(file) for file in files)
        count = 0
        with (
            (tmp / "all.bin").open("wb") as all_tokens,
            tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not sys.stderr.isatty()
            ) as progress,
        ):
            for ids in encoded(tokenizer, files, progress, getattr(args, "processes", 1)):
                ids = ids.astype(dtype)
                all_tokens.write(ids.tobytes())
                count += ids.size
        num_train = int(count * (1 - args.val_fraction))
        if num_train < 2 or count - num_train < 2:
            raise ConfigError(
                f"--val-fraction {args.val_fraction}: leaves a split of {min(num_train, count - num_train)} of the "
                f"{count} tokens"
            )
        tokens = np.memmap(tmp / "all.bin", dtype=dtype, mode="r")
        for name, part in (("train", tokens[:num_train]), ("val", tokens[num_train:])):
            with (tmp / f"{name}.bin").open("wb") as file:
                for start in range(0, part.size, 1 << 24):  # copied in slices: memory stays flat
                    file.write(part[start : start + (1 << 24)].tobytes())
        del tokens
        (tmp / "all.bin").unlink()
        meta = {
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.size,
            "tokenizer": tokenizer.meta,
            "tokens": {"train": num_train, "val": count - num_train},
            "made_from": made_from,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        if out.exists():
            replace_files(tmp, out)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return f"{out}: {count:,} tokens ({num_train:,} train), vocab_size {tokenizer.size}, {np.dtype(dtype).name}"


def prepare_default(out: Path) -> str:
    """The bundled plays at char level into `out` (benchmark.py's token files), unless they are there already. The
    folder is the benchmark's own: one made by another clone (whose plays' path differs) is made again."""
    from hydraloop.data.text import corpus_path

    args = argparse.Namespace(tokenizer="char", vocab_size=None, special_tokens=[], val_fraction=0.1, overwrite=True)
    return prepare(corpus_path(None), out, args)


def replace_files(new: Path, out: Path) -> None:
    """A prepared folder's files replaced by those in `new`, meta.json last: it goes first, so a folder caught half
    way is no prepared folder (data=tokens refuses it) rather than one whose meta.json describes other files. Files
    of OUT that are not ours stay."""
    (out / "meta.json").unlink(missing_ok=True)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        if (new / name).exists():
            os.replace(new / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)  # a BPE's tokenizer.json, replaced by a char corpus
    os.replace(new / "meta.json", out / "meta.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a text file, or a folder of .txt files")
    parser.add_argument("out", type=Path, help="the folder to write train.bin, val.bin and meta.json into")
    parser.add_argument("--tokenizer", default="char", help="char, byte, bpe, or a tokenizer.json / model folder")
    parser.add_argument("--vocab-size", type=int, default=None, help="--tokenizer bpe: tokens in the vocabulary")
    parser.add_argument(
        "--special-tokens", nargs="*", default=[], help="--tokenizer bpe: tokens of their own, e.g. '<|endoftext|>'"
    )
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the last fraction of tokens is val")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT's token files of another corpus")
    parser.add_argument(
        "--processes", type=int, default=min(8, os.cpu_count() or 1), help="char, byte: encoding processes"
    )
    args = parser.parse_args()
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: must be at least 1")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction {args.val_fraction}: must be between 0 and 1")
    try:
        print(prepare(args.source, args.out, args))
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
