"""The tokenizer a data config's token ids were made with: which one (`token_maker`, which a resume compares), and
text to ids and back through it (`Codec`, for scripts/sample.py and scripts/export_hf.py): data=text's characters or
bytes, data=tokens' tokenizer (char, BPE, a Hugging Face tokenizer.json), or data=hf's transformers tokenizer.
"""

import hashlib
from pathlib import Path
from typing import Any

import torch

from hydraloop.data.text import decode as decode_text
from hydraloop.data.text import encode as encode_text
from hydraloop.errors import ConfigError
from hydraloop.huggingface import load_tokenizer


def token_maker(data: dict[str, Any]) -> dict | None:
    """What made a data config's token ids, alike for data=text and data=tokens (the same characters give the same
    ids either way): data=tokens' tokenizer, or data=text's characters (its vocab; null: bytes). None: not text."""
    if data.get("tokenizer"):
        return data["tokenizer"]
    if data.get("vocab") is not None:
        return {"kind": "char", "vocab": data["vocab"]}
    # Every data config has the schema's `vocab` key (null): bytes are data=text's level byte, not any data's.
    if (data.get("dataset") or {}).get("level") == "byte":
        return {"kind": "byte"}
    return None


def names_a_tokenizer(data: dict[str, Any]) -> bool:
    """Whether a checkpoint's data config says how its tokens were made: data=text, data=tokens or data=hf."""
    return token_maker(data) is not None or "tokenizer" in data or bool((data.get("dataset") or {}).get("tokenizer"))


class Codec:
    """Text to token ids and back, as the tokenizer a checkpoint's data was made with (its config's `data`): data=text's
    vocabulary, or data=tokens' tokenizer (a Hugging Face one is read from the prepared folder, and must be the file
    training used), or data=hf's: the model's tokenizer as `data.dataset.tokenizer` names it. For scripts/sample.py and
    scripts/export_hf.py."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        tokenizer = data.get("tokenizer") or {"kind": "text"}
        self.kind, self.vocab, self.hf = tokenizer.get("kind"), data.get("vocab"), None
        self.pretrained = None  # data=hf's transformers tokenizer, padding token and all
        hf_spec = (data.get("dataset") or {}).get("tokenizer")
        if not data.get("tokenizer") and self.vocab is None and isinstance(hf_spec, str):
            self.kind = "huggingface"
            self.pretrained = load_tokenizer(hf_spec, (data.get("dataset") or {}).get("pad_token"))
            self.hf = self.pretrained.backend_tokenizer
        elif self.kind == "char":
            self.vocab = tokenizer["vocab"]
        elif self.kind in ("bpe", "huggingface"):
            path = Path(str(data.get("dataset", {}).get("dir"))) / tokenizer["file"]
            if not path.is_file():
                relative = "" if path.is_absolute() else ", a path relative to where training ran: run from there"
                raise ConfigError(f"{source}: its tokenizer, {path}, is gone (the folder training read{relative})")
            if hashlib.sha256(path.read_bytes()).hexdigest() != tokenizer["sha256"]:
                raise ConfigError(f"{source}: {path} is not the tokenizer it was trained with (prepared again since?)")
            from tokenizers import Tokenizer

            self.hf = Tokenizer.from_file(str(path))
        elif self.kind not in ("text", "byte"):
            raise ConfigError(
                f"{source}: its tokens were made by a tokenizer of kind {self.kind!r}, which cannot decode"
            )

    def encode(self, text: str, where: str) -> torch.Tensor:
        if self.hf is not None:
            return torch.tensor(self.hf.encode(text).ids, dtype=torch.int64)
        return encode_text(text, self.vocab, where=where)

    def decode(self, tokens: torch.Tensor) -> str:
        if self.hf is not None:
            return self.hf.decode(tokens.tolist())
        return decode_text(tokens, self.vocab)

    def default_prompt(self) -> str:
        """A newline, as nanoGPT starts: a text's natural beginning; a vocabulary without one starts at its first."""
        return "\n" if self.vocab is None or "\n" in self.vocab else self.vocab[0]
