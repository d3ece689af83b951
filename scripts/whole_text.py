"""How scripts/prepare_text.py encodes a file through a Hugging Face tokenizer: as `tokenizer.encode(text).ids` gives
the ids of its whole text, from its lines a batch at a time (WholeTextEncoder)."""

import sys
from collections.abc import Iterator
from itertools import accumulate
from typing import NamedTuple

import numpy as np
from text_sources import BATCH_BYTES

PIECE_CHARS = 1 << 14  # a batch is encoded by a Hugging Face tokenizer in pieces of about this many characters
LONGEST_UNCUT = 4 * BATCH_BYTES  # a text this long without a place no word crosses is cut at a line's end anyway
# Before a piece that continues a file's text, for a tokenizer that adds a space before every text it encodes
# (ByteLevel(add_prefix_space=True)): it starts with a space, so none is added, and its last word (of GPT-2's and
# Llama 3's regular expressions) ends where the piece's first word starts, as the text before it did: a line break
# before a word, a letter before whitespace (each joins the other). Its tokens are dropped.
CONTEXT_BEFORE_WORD, CONTEXT_BEFORE_WHITESPACE = " \n", " a"


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
