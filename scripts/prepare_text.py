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
its pre-tokenizer that spans a line break (a byte-level BPE's indent, 'ĊĠĠĠ') as one word (WholeTextEncoder; its
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
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from hydraloop.data.text import encode
from hydraloop.errors import ConfigError

BATCH_BYTES = 1 << 20  # lines read and encoded together
PIECE_CHARS = 1 << 14  # a batch is encoded by a Hugging Face tokenizer in pieces of about this many characters
LONGEST_UNCUT = 4 * BATCH_BYTES  # a text this long without a place no word crosses is cut at a line's end anyway
# Before a piece that continues a file's text, for a tokenizer that adds a space before every text it encodes
# (ByteLevel(add_prefix_space=True)): it starts with a space, so none is added, and its last word (of GPT-2's and
# Llama 3's regular expressions) ends where the piece's first word starts, as the text before it did: a line break
# before a word, a letter before whitespace (each joins the other). Its tokens are dropped.
CONTEXT_BEFORE_WORD, CONTEXT_BEFORE_WHITESPACE = " \n", " a"


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


class Tokens(NamedTuple):
    """A text's tokens: their ids, (start, end) characters and pre-tokenizer words' ids."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    words: list[int | None]


class WholeTextEncoder:
    """A Hugging Face tokenizer's ids of a file as `tokenizer.encode(text).ids` gives them for its whole text
    (truncation and padding aside), from its lines a batch at a time: the tokens the post-processor adds, once at the
    file's start and end; and the text cut only where no word of the pre-tokenizer crosses. Encoded line by line,
    a BOS would start every line, and a byte-level BPE (GPT-2's) would never see the words that span a line break:
    a blank line or an indent belongs to the line break before it ('ĊĊ', 'ĊĠĠĠ'), which its merges join.

    A batch is encoded in pieces of about PIECE_CHARS, on every core (the tokenizers library's threads), each piece
    reaching a line past the start of the next: where a piece's words start is taken as final one line before its
    text ends (as the regular expressions of GPT-2's, Llama 3's and BERT's pre-tokenizers make it), so the next piece
    starts there if no word crosses that place, and otherwise the batch is encoded again from that word on. What
    follows the last place no word crosses, before the batch's last line, is encoded with the next batch.

    A tokenizer that adds a space before every text it encodes (ByteLevel(add_prefix_space=True)) adds it to the
    whole text's start alone: a piece after it is encoded after a context (CONTEXT_BEFORE_WORD), whose tokens are
    dropped."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.post_processor = tokenizer.post_processor
        self.words = HFTokenizer.from_str(tokenizer.to_str())  # the text's tokens alone, as many as the text makes
        self.words.post_processor = None
        self.words.no_truncation()
        self.words.no_padding()
        self.added: tuple[list[int], list[int]] | None = None  # the post-processor's ids before and after a text
        self.warned = False
        # A word encoded alone otherwise than after a line break: the tokenizer adds a space before a text.
        alone, after = self.words.encode("a"), self.words.encode(CONTEXT_BEFORE_WORD + "a")
        after_ids = [i for i, (_, end) in zip(after.ids, after.offsets) if end > len(CONTEXT_BEFORE_WORD)]
        self.adds_prefix_space = alone.ids != after_ids

    def file_ids(self, batches: Iterator[list[str]]) -> Iterator[np.ndarray]:
        carry, started, continued = "", False, False  # continued: carry starts past the file's start
        for batch in batches:
            text = carry + "".join(batch)
            line_starts = list(accumulate((len(line) for line in batch[:-1]), initial=len(carry)))
            ids, cut = self._encoded_until(text, line_starts, continued)
            carry, continued = text[cut:], continued or cut > 0
            if ids and not started:
                yield np.array(self.added[0], dtype=np.int64)
                started = True
            yield np.array(ids, dtype=np.int64)
        ids = self._encode([carry], [continued])[0].ids if carry else []
        if not ids and not started:  # no text tokens: what the post-processor makes of none
            empty = self.words.encode("")
            yield np.array(self.post_processor.process(empty).ids if self.post_processor else [], dtype=np.int64)
            return
        yield np.array((self.added[0] if not started else []) + ids + self.added[1], dtype=np.int64)

    def _encoded_until(self, text: str, line_starts: list[int], continued: bool) -> tuple[list[int], int]:
        """The ids of `text` (past the file's start if `continued`) up to a place no word crosses, at or before its
        last line's start, and that place."""
        end = line_starts[-1]
        stops, previous = [], 0
        for start in line_starts[:-1]:  # a line starting with a word, not an indent: a likely place no word crosses
            if start - previous >= PIECE_CHARS and not text[start].isspace():
                stops.append(start)
                previous = start
        stops.append(end)
        line_ends = dict(zip(line_starts, [*line_starts[1:], len(text)]))
        pieces = list(zip([0, *stops[:-1]], stops))
        pieces_text = [text[start : line_ends[stop]] for start, stop in pieces]
        encodings = self._encode(pieces_text, [continued or start > 0 for start, _ in pieces])
        ids, position, taken = [], 0, 0
        for (start, stop), encoding in zip(pieces, encodings):
            if start != position:  # a word crossed the last piece's stop: the rest again, from that word on
                encoding, stop = self._encode([text[position:]], [continued or position > 0])[0], end
            taken, cut = uncrossed(encoding, stop - position)
            ids += encoding.ids[:taken]
            position += cut
            if stop == end:
                break
        if len(text) - position > LONGEST_UNCUT:  # no pre-tokenizer (the whole text one word), or a line that long
            if not self.warned:
                print(
                    f"prepare_text.py: {len(text) - position:,} characters with no place that no word crosses: cut "
                    "at a line's end, where the whole text's ids may differ",
                    file=sys.stderr,
                )
                self.warned = True
            ids += encoding.ids[taken:]  # the last piece's, which reaches the text's end
            position = len(text)
        return ids, position

    def _encode(self, texts: list[str], continued: list[bool]) -> list[Tokens]:
        """Each text's tokens as the whole text's from there: a text that continues the file's text past its start
        (`continued`) with no space added before it."""
        context = [
            (CONTEXT_BEFORE_WHITESPACE if text[:1].isspace() else CONTEXT_BEFORE_WORD)
            if self.adds_prefix_space and more and not text.startswith(" ")
            else ""
            for text, more in zip(texts, continued)
        ]
        encodings = self.words.encode_batch([before + text for before, text in zip(context, texts)])
        tokens = []
        for before, encoding in zip(context, encodings):
            self._read_added(encoding)
            ids, offsets, words = encoding.ids, encoding.offsets, encoding.word_ids
            if before:  # the context's tokens dropped: those ending in it (one reaching into the text is kept)
                first = next((i for i, (_, token_end) in enumerate(offsets) if token_end > len(before)), len(ids))
                offsets = [(max(start - len(before), 0), stop - len(before)) for start, stop in offsets[first:]]
                ids, words = ids[first:], words[first:]
            tokens.append(Tokens(ids, offsets, words))
        return tokens

    def _read_added(self, encoding):
        """`encoding`, after reading off it (once) the ids the post-processor adds before and after a text."""
        if self.added is None and encoding.ids:
            processed = self.post_processor.process(encoding) if self.post_processor else encoding
            inside = [i for i, sequence in enumerate(processed.sequence_ids) if sequence is not None]
            self.added = (processed.ids[: inside[0]], processed.ids[inside[-1] + 1 :])
        return encoding


def uncrossed(tokens: Tokens, limit: int) -> tuple[int, int]:
    """(tokens, characters) of `tokens` before the last place at or before character `limit` that no word (of its
    pre-tokenizer: its tokens share a word id) crosses."""
    offsets, words = tokens.offsets, tokens.words
    after = len(offsets)
    while after and offsets[after - 1][1] > limit:
        after -= 1
    if after == len(offsets):
        return after, limit
    first = after  # the first token to end past the limit: its word's first token
    while first and words[after] is not None and words[first - 1] == words[after]:
        first -= 1
    if first == after and offsets[after][0] >= limit:  # a word starts at or past the limit: none crosses it
        return after, limit
    return first, offsets[first][0]


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
    """The bundled plays at char level into `out` (benchmark.py's token files), unless they are there already."""
    from hydraloop.data.text import corpus_path

    args = argparse.Namespace(tokenizer="char", vocab_size=None, special_tokens=[], val_fraction=0.1, overwrite=False)
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
