"""Write a model=hf checkpoint as a Hugging Face folder: `from_pretrained` loads it anywhere, without hydraloop.

    python scripts/export_hf.py outputs/DATE/TIME/checkpoints/best.pt exported/
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('exported')"

The folder holds what `save_pretrained` writes (config.json, model.safetensors) and the tokenizer the data was
encoded with, as a transformers tokenizer: data=tokens' BPE or Hugging Face tokenizer itself; data=text's characters
(or bytes) as a tokenizer of one character (byte) per token with the same ids; the pretrained folder's own tokenizer
where the data was tokenized by it. The model is rebuilt as transformers builds it (its own dropout and attention:
hydraloop's keyed ones hold no weights), the checkpoint's weights loaded into it (model.lora's adapters then merged
into the weights they adapt: the folder holds a plain model), and the export is read back with
`from_pretrained` and must give the checkpoint's logits, or nothing is left behind. The folder is written under a
temporary name and renamed: an existing folder is never overwritten. Bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from hydraloop.checkpoint import load_checkpoint
from hydraloop.data.codec import Codec, names_a_tokenizer
from hydraloop.errors import BAD_INPUT_EXIT_CODE, ConfigError
from hydraloop.huggingface import import_transformers

HF_MODEL = "hydraloop.models.hf.hf_model"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a model=hf checkpoint, e.g. checkpoints/best.pt")
    parser.add_argument("out", type=Path, help="the folder to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    try:
        difference = export(args.checkpoint, args.out)
    except ConfigError as error:
        print(f"export_hf.py: {error}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    print(f"wrote {args.out}: from_pretrained gives the checkpoint's logits (largest difference {difference:.1e})")
    return 0


def export(checkpoint_path: Path, out: Path) -> float:
    """Writes the folder; returns the largest difference between the checkpoint's logits and the export's."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; name a new one (nothing is overwritten)")
    checkpoint, config = _read(checkpoint_path)
    transformers = import_transformers()
    # The architecture training built (a pretrained model's embeddings as many as its config says, past its
    # tokenizer's ids where it pads them), without reading the weights the checkpoint replaces; with transformers' own
    # dropout and attention.
    model = instantiate(config["model"], read_weights=False, keyed_dropout=False).eval()
    model.load_state_dict(checkpoint["model"])
    expected = _logits(model)
    if config["model"].get("lora") is not None:  # LoRA's adapters added into the weights they adapt: a plain model
        model = model.merge_and_unload()
    tokenizer = _tokenizer(config, transformers, str(checkpoint_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        auto_class = getattr(transformers, config["model"]["auto_class"])  # as a user loads it
        difference = (_logits(auto_class.from_pretrained(staging).eval()) - expected).abs().max().item()
        if difference > 1e-5:  # not bad input: an export that would not be the checkpoint's model
            raise RuntimeError(f"{checkpoint_path}: the export's logits differ from the checkpoint's by {difference}")
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return difference


def _read(path: Path) -> tuple[dict, dict]:
    checkpoint = load_checkpoint(path, source=str(path))  # a missing or unreadable file is one line there
    config = checkpoint.get("config") or {}
    target = (config.get("model") or {}).get("_target_")
    if target != HF_MODEL:
        raise ConfigError(f"{path}: not a model=hf checkpoint (its model is {target}); only those export to a folder")
    return checkpoint, config


def _tokenizer(config: dict, transformers: Any, source: str) -> Any:
    """The data's tokenizer as a transformers one; None where the data was not text (a classifier of features)."""
    data = config.get("data") or {}
    if names_a_tokenizer(data):
        return as_transformers_tokenizer(Codec(data, source), transformers)
    name_or_path = config["model"].get("name_or_path")
    if name_or_path is not None:
        try:
            return transformers.AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except OSError:
            return None
    return None


def as_transformers_tokenizer(codec: Codec, transformers: Any) -> Any:
    """data=tokens' Hugging Face tokenizer itself; a character (or byte) vocabulary as a word-level tokenizer with
    one token per character (byte), the same ids, and a decoder that joins them back without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if codec.pretrained is not None:  # data=hf's: the model's own, as training loaded it
        return codec.pretrained
    tokenizer = codec.hf
    if tokenizer is None:
        one_each = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
        if codec.vocab is None:  # bytes, as the printable stand-ins byte-level tokenizers show them as
            stand_ins = byte_stand_ins()
            tokenizer = Tokenizer(models.WordLevel({stand_ins[b]: b for b in range(256)}, unk_token=None))
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([byte_level, one_each])
            tokenizer.decoder = decoders.ByteLevel()
        else:
            tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(codec.vocab)}, unk_token=None))
            tokenizer.pre_tokenizer = one_each
            tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def byte_stand_ins() -> dict[int, str]:
    """GPT-2's byte-to-character table (what tokenizers' ByteLevel shows bytes as): printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits for two fixed rows of ids: the checkpoint's and the export's must match."""
    config = model.config
    length = min(8, getattr(config, "max_position_embeddings", 8) or 8)
    ids = torch.randint(0, config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


if __name__ == "__main__":
    sys.exit(main())
