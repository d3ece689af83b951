"""The data of the data=hf tests: scripts/make_play_lines.py's csv of labelled lines (which play a line of Shakespeare
is from), and a tokenizer trained on those lines."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "make_play_lines", Path(__file__).resolve().parents[1] / "scripts" / "make_play_lines.py"
)
make_play_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_play_lines)


def write_plays(folder: Path) -> tuple[Path, Path]:
    """(the csv, a byte-level BPE of 300 tokens trained on its lines, with a <pad> token), written into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    csv = make_play_lines.write_play_lines(folder / "plays.csv")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    lines = (line for line, _ in make_play_lines.play_lines())
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return csv, folder / "tokenizer.json"
