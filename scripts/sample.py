"""Generate text from a language-model checkpoint (model=gpt, or model=hf's causal LMs; data=text, data=tokens or
data=hf_lm), as nanoGPT's sample.py does.

    python scripts/sample.py outputs/DATE/TIME/checkpoints/best.pt --prompt "ROMEO:" --max-new-tokens 500

Rebuilds the model from the checkpoint's own config (`config.model`, with hydra.utils.instantiate), loads its
weights and decodes with the vocabulary stored in its config (`config.data.vocab`, null for bytes), or with
data=tokens' tokenizer (`config.data.tokenizer`: a BPE's tokenizer.json is read from the prepared folder, and must
be the file training used), or data=hf_lm's (`config.data.dataset.tokenizer`), so the text comes back exactly as
training encoded it. Only the tokenizer's ids are drawn, where the model's vocabulary is padded past them. The same
checkpoint, prompt, settings, seed and device give the same text. Bad input (no such file, not a language-model
checkpoint, a prompt character outside the vocabulary) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from hydraloop.checkpoint import load_checkpoint
from hydraloop.data.codec import Codec, names_a_tokenizer
from hydraloop.errors import BAD_INPUT_EXIT_CODE, ConfigError
from hydraloop.models.hf import generate as hf_generate
from hydraloop.models.hf import is_transformers_model
from hydraloop.parallel.single import resolve_device

SEPARATOR = "---------------"  # between samples, as nanoGPT prints them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint written by training, e.g. checkpoints/best.pt")
    parser.add_argument("--prompt", default=None, help="text to continue (default: a newline, or the first token)")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0: all")
    parser.add_argument(
        "--num-samples", type=int, default=1, help=f"printed one after another, with {SEPARATOR} between"
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    try:
        texts = sample(args)
    except ConfigError as error:
        print(f"sample.py: {error}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    print(f"\n{SEPARATOR}\n".join(texts))
    return 0


def sample(args: argparse.Namespace) -> list[str]:
    for flag, value, low in (("max-new-tokens", args.max_new_tokens, 0), ("num-samples", args.num_samples, 1)):
        if value < low:
            raise ConfigError(f"--{flag}={value}: must be at least {low}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature}: must be >= 0 (0: greedy)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k}: must be >= 0 (0: no limit)")
    device = resolve_device(args.device)
    model, codec, vocab_size = load_language_model(args.checkpoint, device)
    prompt = args.prompt if args.prompt is not None else codec.default_prompt()
    idx = codec.encode(prompt, where=f"--prompt={prompt!r}").to(device)
    if idx.numel() == 0:
        raise ConfigError("--prompt='': give at least one character")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    torch.manual_seed(args.seed)  # a transformers model's generate draws from torch's global generator
    samples = []
    for _ in range(args.num_samples):
        if is_transformers_model(model):
            tokens = hf_generate(model, idx[None], args.max_new_tokens, args.temperature, args.top_k, vocab_size)
        else:
            options = {"top_k": args.top_k or None, "generator": generator, "vocab_size": vocab_size}
            tokens = model.generate(idx[None], args.max_new_tokens, args.temperature, **options)
        samples.append(codec.decode(tokens[0].cpu()))
    return samples


def load_language_model(path: Path, device: torch.device) -> tuple[torch.nn.Module, Codec, int | None]:
    """The checkpoint's model, on `device` in eval mode, the codec of its tokens, and how many ids the codec has
    (the data's vocab_size: the model's may be padded past it, and ids there decode to nothing)."""
    if path.is_dir():  # a sharded checkpoint (parallel=fsdp's), read whole
        checkpoint: Any = load_checkpoint(path, source=str(path))
    elif not path.is_file():
        raise ConfigError(f"{path}: no such file")
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # not a checkpoint at all: one line, without the unpickler's story
            first_line = str(error).strip().splitlines()[0]
            raise ConfigError(f"{path}: cannot be read as a checkpoint: {first_line}") from None
    config = checkpoint.get("config") if isinstance(checkpoint, dict) else None
    if not isinstance(config, dict) or "model" not in checkpoint or "model" not in config:
        raise ConfigError(f"{path}: not a hydraloop checkpoint (needs 'model' and 'config' with a 'model' section)")
    data = config.get("data") or {}
    if not names_a_tokenizer(data):
        raise ConfigError(
            f"{path}: not a language-model checkpoint (its data config has no vocab or tokenizer; train with "
            "data=text, data=tokens or data=hf_lm)"
        )
    model = instantiate(config["model"])
    if not callable(getattr(model, "generate", None)):
        task = (config.get("task") or {}).get("_target_", "?")
        raise ConfigError(
            f"{path}: its model, {type(model).__name__} (task {task}), is not a language model with a generate "
            "method; scripts/sample.py samples from those (model=gpt or a causal model=hf, task=language_model)"
        )
    model.load_state_dict(checkpoint["model"])
    return model.to(device).eval(), Codec(data, str(path)), data.get("vocab_size")


if __name__ == "__main__":
    sys.exit(main())
