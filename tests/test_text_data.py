"""data=text: char and byte tokens from a file, split by position, cut into (x, y) windows; the vocabulary resolved
into the config; the bundled corpus; each bad input one line naming the key and value."""

import math
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import REPO, bad_input_line
from hydraloop.config import register_configs
from hydraloop.data.text import (
    corpus_path,
    decode,
    encode,
    load_text,
    read_text,
    text_vocab,
    unigram_entropy,
    vocab_size,
)
from hydraloop.errors import ConfigError

TEXT = "abcdefghijklmnopqrst"  # 20 distinct characters: token i is the i-th letter


@pytest.fixture
def text_file(tmp_path):
    """text_file(content: str | bytes, name="corpus.txt") -> path of a new file holding it."""

    def write(content: str | bytes, name: str = "corpus.txt") -> str:
        path = tmp_path / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    return write


def rejected(**kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        load_text(**kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_split_by_position_into_shifted_windows(text_file):
    path = text_file(TEXT)
    vocab = text_vocab(path, "char")
    assert vocab == TEXT and vocab_size(vocab) == 20
    train, val = load_text(block_size=4, vocab=vocab, path=path, val_fraction=0.25)
    # Train: tokens 0-14, windows of 5 at starts 0, 4, 8 (12 + 5 > 15). Val: tokens 15-19, one window.
    assert len(train) == 3 and len(val) == 1
    x, y = train[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4]
    assert train[2][0].tolist() == [8, 9, 10, 11] and train[2][1].tolist() == [9, 10, 11, 12]
    assert val[0][0].tolist() == [15, 16, 17, 18] and val[0][1].tolist() == [16, 17, 18, 19]  # where train ends
    assert train.tensors[0].dtype == train.tensors[1].dtype == torch.int64


def test_stride_sets_the_overlap(text_file):
    path = text_file(TEXT)
    train, _ = load_text(block_size=4, vocab=text_vocab(path, "char"), path=path, val_fraction=0.25, stride=1)
    assert len(train) == 15 - 5 + 1
    assert [x[0].item() for x, _ in train] == list(range(11))


def test_vocabulary_round_trip_with_any_unicode(text_file):
    text = 'Dès l\'aube, 夜明け 🌅\nnaïve—"quoted"\tend\r\n'
    path = text_file(text)
    vocab = text_vocab(path, "char")
    assert vocab == "".join(sorted(set(text)))
    ids = encode(text, vocab)
    assert ids.dtype == torch.int64 and len(ids) == len(text) and ids.max() < len(vocab)
    assert decode(ids, vocab) == text
    assert decode(ids.tolist(), vocab) == text
    assert read_text(path, "char") == text


def test_a_given_vocabulary_keeps_its_order():
    assert encode("cab", "cba").tolist() == [0, 2, 1]
    assert decode([2, 1, 0], "cba") == "abc"


def test_byte_level_reads_any_file(text_file):
    content = "héllo".encode() + b"\xff\x00"  # not UTF-8: fine at byte level
    path = text_file(content)
    assert text_vocab(path, "byte") is None and vocab_size(None) == 256
    ids = encode(read_text(path, "byte"), None)
    assert ids.tolist() == list(content)
    assert decode(encode("héllo", None), None) == "héllo"
    assert decode([104, 0xC3], None) == "h\ufffd"  # a cut-off UTF-8 sequence decodes to U+FFFD
    train, val = load_text(block_size=2, vocab=None, path=path, level="byte", val_fraction=0.4)
    assert train[0][0].tolist() == [104, 0xC3] and val[0][0].tolist() == list(content[4:6])


def test_bundled_corpus_when_no_path():
    path = corpus_path(None)
    assert path.name == "shakespeare.txt" and (path.parent / "README.md").is_file()
    assert path.stat().st_size == 419133
    vocab = text_vocab(None, "char")
    assert len(vocab) == 73 and vocab[0] == "\n"
    train, val = load_text(block_size=256, vocab=vocab)
    assert (len(train), len(val)) == (1473, 163)
    assert decode(train[0][0][:16], vocab) == "ROMEO AND JULIET"
    # The README's figure: what a model that ignores context scores (nats per character).
    assert unigram_entropy(encode(read_text(None, "char"), vocab)) == pytest.approx(3.2715, abs=1e-4)


def test_unigram_entropy():
    assert unigram_entropy(torch.tensor([0, 1, 2, 3])) == pytest.approx(math.log(4))
    assert unigram_entropy(torch.tensor([5, 5, 5])) == 0


def test_config_resolves_vocab_and_sizes_for_the_model(text_file):
    path = text_file("to be, or not to be\n" * 10)
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["data=text", "model=gpt", f"data.dataset.path={path}", "data.block_size=8", "model.n_embd=32"],
        )
    config = OmegaConf.to_container(cfg.data, resolve=True) | {"model": OmegaConf.to_container(cfg.model, resolve=True)}
    assert config["vocab"] == "\n ,benort" and config["vocab_size"] == 9 == config["num_classes"]
    assert config["input_shape"] == [8] and config["dataset"]["stride"] == 8
    assert config["model"]["vocab_size"] == 9 and config["model"]["block_size"] == 8
    train, val = instantiate(cfg.data.dataset)
    assert train[0][0].shape == (8,) and len(train) == (180 - 9) // 8 + 1 and len(val) == (20 - 9) // 8 + 1
    assert instantiate(cfg.model)(train[0][0][None]).shape == (1, 8, 9)


@pytest.mark.parametrize("level", ["char", "byte"])
def test_file_problems(tmp_path, text_file, level):
    missing = tmp_path / "missing.txt"
    assert rejected(block_size=4, vocab="a", path=str(missing), level=level) == (
        f"data.dataset.path={missing}: no such file ({missing})"
    )
    assert rejected(block_size=4, vocab="a", path=str(tmp_path), level=level) == (
        f"data.dataset.path={tmp_path}: a directory, not a file ({tmp_path})"
    )
    empty = text_file(b"", "empty.txt")
    assert rejected(block_size=4, vocab="a", path=empty, level=level) == f"data.dataset.path={empty}: the file is empty"


def test_not_utf8_names_the_byte_offset(text_file):
    path = text_file(b"abc\xe9def")  # Latin-1 'e acute'
    message = (
        f"data.dataset.path={path}: not UTF-8 text (byte 0xe9 at offset 3); data.dataset.level=byte reads any file"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        text_vocab(path, "char")
    assert rejected(block_size=2, vocab="abcdef", path=path) == message


def test_bad_settings(text_file):
    path = text_file(TEXT)
    ok = dict(block_size=4, vocab=TEXT, path=path)
    assert rejected(**ok | dict(block_size=0)) == "data.block_size=0: must be a positive integer"
    assert rejected(**ok | dict(stride=0)) == "data.dataset.stride=0: must be a positive integer"
    for fraction in (0, 1, 1.5):
        assert rejected(**ok | dict(val_fraction=fraction)) == (
            f"data.dataset.val_fraction={fraction}: must be between 0 and 1 (exclusive)"
        )
    assert rejected(**ok | dict(level="word")) == "data.dataset.level=word: must be one of char, byte"
    assert rejected(**ok | dict(level="byte")) == (
        f"data.vocab='{TEXT}': must be null at data.dataset.level=byte (the 256 bytes)"
    )
    assert rejected(**ok | dict(vocab=None)) == "data.vocab=None: data.dataset.level=char needs a vocabulary string"


def test_split_too_short_for_one_block(text_file):
    path = text_file(TEXT)
    assert rejected(block_size=4, vocab=TEXT, path=path, val_fraction=0.2) == (
        f"data.block_size=4: the val split of data.dataset.path={path} has 4 tokens (data.dataset.val_fraction=0.2 "
        "of 20), fewer than the block_size + 1 = 5 one sample needs"
    )
    assert rejected(block_size=16, vocab=TEXT, path=path, val_fraction=0.5) == (
        f"data.block_size=16: the train split of data.dataset.path={path} has 10 tokens "
        "(data.dataset.val_fraction=0.5 of 20), fewer than the block_size + 1 = 17 one sample needs"
    )


def test_characters_outside_a_given_vocabulary(text_file):
    path = text_file("abcXbYZ")
    assert rejected(block_size=2, vocab="abc", path=path) == (
        f"data.dataset.path={path}: character 'X' at position 3 is not in the vocabulary of 3 characters "
        "(and 2 other characters)"
    )
    with pytest.raises(ConfigError, match=r"^data.vocab='aa': must be distinct characters, at least one$"):
        encode("a", "aa")


def test_a_vocabulary_omegaconf_would_read_as_interpolation(text_file):
    path = text_file("${}$")
    with pytest.raises(ConfigError) as error:
        text_vocab(path, "char")
    assert str(error.value) == (
        f"data.dataset.path={path}: its characters, sorted, contain '${{' (no letters or digits between them), "
        "which OmegaConf cannot hold as data.vocab; use data.dataset.level=byte"
    )


def test_unreadable_file_is_one_line_from_the_launcher(run_train, tmp_path):
    """The vocabulary is resolved in the launcher: a bad file ends the run there, as one line, exit 2."""
    run = run_train("data=text", "model=gpt", f"data.dataset.path={tmp_path}/nope.txt", "logger=none")
    assert bad_input_line(run).endswith(f"data.dataset.path={tmp_path}/nope.txt: no such file ({tmp_path}/nope.txt)")
