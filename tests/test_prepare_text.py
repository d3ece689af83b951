"""scripts/prepare_text.py: token files that several processes encode as one, a folder prepared again left as it is
and another corpus's refused, any file's bytes, a cut gzip file in one line, and each file encoded through a Hugging
Face tokenizer as its whole text."""

import argparse
import gzip

import numpy as np
import pytest

from conftest import REPO, prepare_tokens
from hydraloop.data.text import corpus_path


@pytest.fixture
def script_modules(monkeypatch):
    """prepare_text.py and the modules beside it that it imports, imported as the script imports them."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import prepare_text
    import text_sources
    import whole_text

    return prepare_text, text_sources, whole_text


def test_several_processes_encode_the_same_token_files_as_one(train_env, tmp_path):
    text = tmp_path / "corpus.txt"
    lines = [f"line {i}: {'abcdefghij' * (i % 7)} é\n" for i in range(60000)]
    text.write_text("".join(lines))  # about 3 MB: batches of 1 MB for the processes to share
    for tokenizer in ("char", "byte"):
        outs = [tmp_path / f"{tokenizer}{n}" for n in (1, 3)]
        for out, n in zip(outs, (1, 3)):
            done = prepare_tokens(text, out, "--tokenizer", tokenizer, "--processes", str(n), env=train_env)
            assert done.returncode == 0, done.stderr
        for name in ("train.bin", "val.bin", "meta.json"):
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), (tokenizer, name)


def test_preparing_again_leaves_the_folder_and_another_corpus_is_refused(train_env, char_tokens, tmp_path):
    before = {path.name: path.stat().st_mtime_ns for path in char_tokens.iterdir()}
    again = prepare_tokens(corpus_path(None), char_tokens, env=train_env)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stderr
    assert {path.name: path.stat().st_mtime_ns for path in char_tokens.iterdir()} == before
    other = tmp_path / "other.txt"
    other.write_text("to be or not to be\n" * 50)
    refused = prepare_tokens(other, char_tokens, env=train_env)
    assert refused.returncode == 2 and "holds token files of other sources or settings" in refused.stderr
    assert {path.name: path.stat().st_mtime_ns for path in char_tokens.iterdir()} == before


def test_the_benchmarks_folder_made_by_another_clone_is_made_again(char_tokens, tmp_path, script_modules):
    """benchmark.py's token folder lives in ~/.cache, shared by every clone; each records its own plays' path."""
    prepare_text, _, _ = script_modules
    other_clone = tmp_path / "clone" / "shakespeare.txt"
    other_clone.parent.mkdir()
    other_clone.write_bytes(corpus_path(None).read_bytes())
    out = tmp_path / "tokens"
    made = prepare_tokens(other_clone, out)
    assert made.returncode == 0, made.stderr
    assert "vocab_size" in prepare_text.prepare_default(out)  # made again, not refused
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (char_tokens / name).read_bytes()
    assert "up to date" in prepare_text.prepare_default(out)


def test_byte_tokens_are_any_files_bytes_and_a_half_made_folder_is_made_again(train_env, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9 cr\xe8me\n" * 40)  # not UTF-8
    out = tmp_path / "bytes"
    assert prepare_tokens(latin1, out, "--tokenizer", "byte", env=train_env).returncode == 0
    tokens = np.concatenate([np.fromfile(out / f"{split}.bin", np.uint16) for split in ("train", "val")])
    assert tokens.tobytes() == np.frombuffer(latin1.read_bytes(), np.uint8).astype(np.uint16).tobytes()
    (out / "val.bin").unlink()  # a folder left half made: the same command makes it again
    again = prepare_tokens(latin1, out, "--tokenizer", "byte", env=train_env)
    assert again.returncode == 0 and "up to date" not in again.stdout and (out / "val.bin").is_file()


def test_a_gzip_file_cut_short_is_one_line_and_nothing_written(train_env, tmp_path):
    cut = tmp_path / "cut.txt.gz"
    cut.write_bytes(gzip.compress(corpus_path(None).read_bytes())[:50_000])
    done = prepare_tokens(cut, tmp_path / "out", env=train_env)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"prepare_text.py: error: SOURCE {cut}: not a whole gzip file (Compressed file ended before the "
        "end-of-stream marker was reached)"
    )
    assert not (tmp_path / "out").exists()


def hf_tokenizer(kind: str, text: str):
    """A tokenizer built here: a byte-level BPE (GPT-2's kind), the same adding a space before a text
    (ByteLevel(add_prefix_space=True): before the whole text's alone), the same adding <s> before a text (Llama's), a
    WordPiece adding [CLS] before and [SEP] after (BERT's), with padding on (a batch encoded padded would pad), or a
    BPE whose words are split at spaces alone (SentencePiece's Metaspace: a line break is inside a word)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "wordpiece [CLS] [SEP]":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
        tokenizer.train_from_iterator([text], trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
        tokenizer.enable_padding(pad_token="[PAD]", pad_id=tokenizer.token_to_id("[PAD]"))
        return tokenizer
    tokenizer = Tokenizer(models.BPE())
    if kind == "metaspace bpe":
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "byte-level bpe prefix space")
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator([text], trainer)  # merges across line breaks too: a blank line's, an indent's
    if kind == "bpe <s>":
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


@pytest.mark.parametrize(
    "kind", ["byte-level bpe", "byte-level bpe prefix space", "bpe <s>", "wordpiece [CLS] [SEP]", "metaspace bpe"]
)
def test_each_file_is_encoded_as_its_whole_text(kind, tmp_path, monkeypatch, script_modules):
    """--tokenizer PATH, a batch of lines at a time (tiny batches here, of pieces of a few lines): each file's ids
    are those of `tokenizer.encode(its text)`: byte-level BPE's merges across line breaks (an indent is one word with
    the line break before it) as they are, and the tokens the post-processor adds once, not on every line."""
    prepare_text, text_sources, whole_text = script_modules
    monkeypatch.setattr(text_sources, "BATCH_BYTES", 2048)
    monkeypatch.setattr(whole_text, "PIECE_CHARS", 300)
    plays = corpus_path(None).read_text()
    indented = "".join(" " * (4 * (i % 3)) + f"line {i}, é\n" + "  \n" * (i % 2) + "\n" for i in range(200))
    texts = {
        "a.txt": plays[:6000] + "<s> as text\n" + "a line longer than a batch " * 150 + "\n\n\n  \n" + indented,
        "b.txt": indented + plays[-6000:] + "\n\n  ",  # no line break at the end
    }
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, text in texts.items():
        (folder / name).write_text(text)
    tokenizer = hf_tokenizer(kind, "".join(texts.values()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    args = dict(tokenizer=str(tmp_path / "tokenizer.json"), vocab_size=None, special_tokens=[], val_fraction=0.1)
    prepare_text.prepare(folder, tmp_path / "tokens", argparse.Namespace(**args, overwrite=False, processes=1))
    ids = np.concatenate([np.fromfile(tmp_path / "tokens" / f"{split}.bin", np.uint16) for split in ("train", "val")])
    whole = [tokenizer.encode(text).ids for text in texts.values()]
    assert ids.tolist() == whole[0] + whole[1]
    lines = [e.ids for text in texts.values() for e in tokenizer.encode_batch(text.splitlines(keepends=True))]
    assert ids.tolist() != sum(lines, [])  # encoded line by line they differ: the test tells the two apart
    if kind == "bpe <s>":  # once a file, and once where the text has it
        assert (ids == tokenizer.token_to_id("<s>")).sum() == 2 + 1
    if kind == "wordpiece [CLS] [SEP]":
        assert [(ids == tokenizer.token_to_id(token)).sum() for token in ("[CLS]", "[SEP]")] == [2, 2]


def test_a_tokenizer_that_makes_the_whole_text_one_word_is_cut_at_a_line_end_after_a_while(
    tmp_path, monkeypatch, capsys, script_modules
):
    """Without a pre-tokenizer the whole text is one word, and no place in it is uncrossed: past LONGEST_UNCUT
    characters it is cut at a line's end all the same, with one line saying so, every character encoded once."""
    from tokenizers import Tokenizer, models, trainers

    prepare_text, text_sources, whole_text = script_modules
    monkeypatch.setattr(text_sources, "BATCH_BYTES", 256)
    monkeypatch.setattr(whole_text, "LONGEST_UNCUT", 1024)
    text = "".join(f"line {i}\n" for i in range(1000))
    (tmp_path / "lines.txt").write_text(text)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=60))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    args = dict(tokenizer=str(tmp_path / "tokenizer.json"), vocab_size=None, special_tokens=[], val_fraction=0.1)
    prepare_text.prepare(tmp_path / "lines.txt", tmp_path / "tokens", argparse.Namespace(**args, overwrite=False))
    ids = np.concatenate([np.fromfile(tmp_path / "tokens" / f"{split}.bin", np.uint16) for split in ("train", "val")])
    assert "".join(tokenizer.id_to_token(int(i)) for i in ids) == text
    assert capsys.readouterr().err.count("with no place that no word crosses: cut at a line's end") == 1
