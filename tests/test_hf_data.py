"""data=hf: a csv of labelled lines (which play a line of Shakespeare is from, scripts/make_play_lines.py), tokenized
with a tokenizer trained here, batches padded to their own longest line; a GPT-2 classifier with dropout on trains
the same weights under ddp, fsdp and accumulation as on one process; what does not fit is one line. data=hf_lm, the
same texts for next-token prediction: tests/test_hf_lm_data.py."""

import pytest
import torch

from conftest import bad_input_line, max_param_diff
from hydraloop.errors import ConfigError

pytest.importorskip("datasets", reason="the hf extra (in dev)")
from tokenizers import Tokenizer  # noqa: E402

from hydraloop.data.hf import load_hf_dataset  # noqa: E402
from hydraloop.huggingface import load_tokenizer  # noqa: E402
from plays import make_play_lines  # noqa: E402


def classifier(plays, *overrides: str) -> list[str]:
    csv, tokenizer = plays
    return [
        *["data=hf", f"data.dataset.path={csv}", "data.num_classes=3", f"data.dataset.tokenizer={tokenizer}"],
        *["data.dataset.pad_token='<pad>'", "data.batch_size=16", "data.block_size=64", "logger=csv"],
        *["model=hf", "model.auto_class=AutoModelForSequenceClassification", "model.model_type=gpt2"],
        *[
            "+model.config.n_layer=1",
            "+model.config.n_embd=32",
            "+model.config.n_head=2",
            "+model.config.n_positions=64",
        ],
        # SGD: AdamW would amplify round-off in the attention's key bias, whose gradient is zero but for round-off
        # (softmax does not see a constant added to every key), and padding to other lengths rounds otherwise.
        *["optimizer=sgd", "optimizer.lr=0.05", "trainer.max_steps=8", *overrides],
    ]


@pytest.fixture(scope="module")
def single(run_train, plays):
    run = run_train(*classifier(plays))
    assert run.returncode == 0, run.output
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel=ddp", "parallel.nproc_per_node=2"],
        ["parallel=fsdp", "parallel.nproc_per_node=2"],
        ["trainer.grad_accum_steps=4"],
    ],
    ids=["ddp", "fsdp", "accum"],
)
def test_padded_batches_split_any_way_train_the_single_process_weights(run_train, plays, single, overrides):
    split = run_train(*classifier(plays, *overrides))
    assert split.returncode == 0, split.output
    assert max_param_diff(split.checkpoint()["model"], single.checkpoint()["model"]) < 1e-5
    assert split.metrics["val/acc"] == single.metrics["val/acc"]
    assert split.metrics["val/loss"] == pytest.approx(single.metrics["val/loss"], rel=1e-5)


def test_batches_are_padded_to_their_longest_line_with_a_mask(plays, tmp_path):
    csv, tokenizer = plays
    train, val = load_hf_dataset(str(csv), str(tokenizer), 3, pad_token="<pad>", max_length=8, cache_dir=str(tmp_path))
    assert len(train) + len(val) == len(make_play_lines.play_lines()) and len(val) == round(
        0.1 * (len(train) + len(val))
    )
    batch = train.collate_fn([train[0], train[1], train[2]])
    lengths = [len(train[i]["input_ids"]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths)) and max(lengths) <= 8  # truncated to max_length
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    pad = load_tokenizer(str(tokenizer), "<pad>").pad_token_id
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad).all()
    assert set(train.labels.tolist()) == {0, 1, 2}  # hamlet, macbeth, romeo_and_juliet: names, numbered sorted


def test_the_cache_is_keyed_by_tokenizer_and_settings(plays, tmp_path):
    csv, tokenizer = plays
    load_hf_dataset(str(csv), str(tokenizer), 3, pad_token="<pad>", max_length=8, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("hf_*.npz"))) == 2  # train and val
    load_hf_dataset(str(csv), str(tokenizer), 3, pad_token="<pad>", max_length=8, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("hf_*.npz"))) == 2  # read back, not written again
    load_hf_dataset(str(csv), str(tokenizer), 3, pad_token="<pad>", max_length=16, cache_dir=str(tmp_path))
    other = Tokenizer.from_file(str(tokenizer))
    other.add_special_tokens(["<sep>"])
    other.save(str(tmp_path / "other.json"))
    load_hf_dataset(str(csv), str(tmp_path / "other.json"), 3, pad_token="<pad>", max_length=8, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("hf_*.npz"))) == 6


def test_the_model_pads_with_the_tokenizers_padding_token(plays):
    from hydraloop.models.hf import hf_model

    _, tokenizer = plays
    with torch.device("meta"):
        model = hf_model(
            "AutoModelForSequenceClassification",
            model_type="gpt2",
            num_labels=3,
            tokenizer=str(tokenizer),
            pad_token="<pad>",
            config={"n_layer": 1, "n_embd": 8, "n_head": 2},
        )
    assert model.config.pad_token_id == load_tokenizer(str(tokenizer), "<pad>").pad_token_id
    assert model.config.vocab_size == 300 and model.score.out_features == 3


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"text_column": "line"}, "data.dataset.text_column=line: PATH has no such column; it has text, label"),
        ({"num_classes": 4}, "data.num_classes=4: label holds 3 names (hamlet, macbeth, romeo_and_juliet"),
        ({"pad_token": None}, "has no padding token; set one of its tokens as data.dataset.pad_token"),
        ({"pad_token": "<nope>"}, "data.dataset.pad_token=<nope>: not a token of"),
        ({"path": "/nowhere/lines.csv"}, "data.dataset.path=/nowhere/lines.csv: no such file"),
        ({"path": "someone/no-such-set"}, "data.dataset.path=someone/no-such-set: cannot be read as a data set"),
        ({"tokenizer": "/nowhere/tok"}, "data.dataset.tokenizer=/nowhere/tok: no such folder or file"),
        ({"tokenizer": "someone/no-such-tok"}, "data.dataset.tokenizer=someone/no-such-tok: no tokenizer there"),
    ],
)
def test_what_does_not_fit_is_one_line(plays, tmp_path, arguments, expected):
    csv, tokenizer = plays
    settings = {"path": str(csv), "tokenizer": str(tokenizer), "num_classes": 3, "pad_token": "<pad>", **arguments}
    with pytest.raises(ConfigError) as error:
        load_hf_dataset(**settings, cache_dir=str(tmp_path))
    assert expected.replace("PATH", str(csv)) in str(error.value) and "\n" not in str(error.value)


def test_a_column_that_is_not_there_is_refused_before_any_rank_starts(run_train, plays, tmp_path):
    run = run_train(*classifier(plays, "data.dataset.label_column=play", "parallel=ddp"), run_dir=tmp_path / "run")
    assert "data.dataset.label_column=play: " in bad_input_line(run) and "it has text, label" in run.output
    assert not (tmp_path / "run").exists()


def test_empty_cells_and_a_model_folder_without_a_tokenizer_are_one_line(plays, tmp_path):
    _, tokenizer = plays
    rows = "".join(f"{'' if i == 7 else 'a line'},{i % 3}\n" for i in range(20))  # row 7's text is empty
    (tmp_path / "gaps.csv").write_text("text,label\n" + rows)
    with pytest.raises(ConfigError, match=r"data.dataset.text_column=text: \S+ has 1 empty cell\(s\) there"):
        load_hf_dataset(str(tmp_path / "gaps.csv"), str(tokenizer), 3, pad_token="<pad>", cache_dir=str(tmp_path))
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "model")  # no tokenizer files
    with pytest.raises(ConfigError, match="model: no tokenizer there \\(none of tokenizer.json") as error:
        load_tokenizer(str(tmp_path / "model"))
    assert str(error.value).count("no tokenizer there") == 1


def test_a_head_for_another_number_of_classes_is_refused_before_any_rank_starts(run_train, plays, tmp_path):
    run = run_train(*classifier(plays, "model.num_labels=5"), run_dir=tmp_path / "run")
    assert "the model gives 5 scores per sample, for data.num_classes=3 classes" in bad_input_line(run)
    assert not (tmp_path / "run").exists()
