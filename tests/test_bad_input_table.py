"""The bad-input promise, one row per kind of mistake, through the real command line: one line naming the key and
the value, exit 2, no traceback, and nothing written (a new run directory is never made). The kinds are those of a
campaign of 182 plausible mistakes: Hydra's composition errors, errors that used to escape as Hydra's "Error
executing job", what only a rank used to find, tracebacks, misleading one-liners, and the helper scripts.

Past 300 lines because it is one table: the campaign's rows (ROWS, TENSOR_FILES, the launcher's variables, the helper
scripts' SCRIPT_ROWS) and the few mistakes that need a setting of their own, each asserting the same promise with the
same helpers (`made`'s files, `assert_refused_before_anything`); read whole, it is the one list of every kind of
mistake the promise covers."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, TRAIN, bad_input_line, free_port

pytestmark = pytest.mark.fast  # the bad-input table, through the fork server: the fast tier

SEARCH = "hparams_search=mnist1d_optuna"
TENSORS = ("data=tensors", "data.input_shape=[3]", "data.num_classes=3")
TINY_HF = (
    "model=hf",
    "model.model_type=gpt2",
    "+model.config.n_layer=1",
    "+model.config.n_embd=16",
    "+model.config.n_head=2",
)
ROWS = [
    # Hydra's composition: a misspelt key, a wrong type, a key of another option, a sweep without -m.
    (["trainer.max_epchs=1"], "trainer.max_epchs=1: trainer has no key 'max_epchs'; did you mean trainer.max_epochs?"),
    (["trainer.compile=ture"], "trainer.compile=ture: must be true or false"),
    (["trainer.limit_train_batches=0.5"], "trainer.limit_train_batches=0.5: must be an integer"),
    (["data.input_shape=5"], "data.input_shape=5: must be a list"),
    (["parallel.nproc_per_node=2"], "(it is a key of parallel=ddp and parallel=fsdp)"),
    (["+trainer.max_epchs=1"], "trainer.max_epchs=1: trainer has no key 'max_epchs'; did you mean max_epochs?"),
    (["trainer.max_epochs=[1"], "trainer.max_epochs=[1: Hydra cannot parse it"),
    (["optimizer.lr=0.1,abc"], "optimizer.lr=0.1,abc: a sweep; add -m"),
    (["hparams_search=mnist1d_optuna"], "hparams_search=mnist1d_optuna: a search runs its trials as a sweep: add -m"),
    # Interpolations that do not resolve; a key of the schema removed; a sweep of no job.
    (["optimizer.lr=${foo}"], "optimizer.lr: cannot resolve its value (Interpolation key 'foo' not found)"),
    (["~trainer"], "~trainer: trainer is a key every run reads"),
    (["-m", "seed=range(0,0)"], "seed=range(0,0): the sweep has no value"),
    (["data=synthetic", "data.input_shape=[0]"], "data.input_shape=[0]: must be positive sizes"),
    (["data=text", "data.block_size=-3"], "data.block_size=-3: must be positive"),  # the key given, not input_shape
    (["parallel=ddp", "parallel.timeout_s=0"], "parallel.timeout_s=0.0: must be a positive number of seconds"),
    (["parallel=fsdp", "parallel.start_method=forkserver"], "parallel.start_method=forkserver: must be one of auto,"),
    # A warm-up in epochs longer than the run (a recipe's, or scheduler=cosine's default), as one in steps is.
    (["experiment=diabetes_mlp", "trainer.max_steps=2"], "a warm-up of 11 steps passes the run's 2 steps (11 per"),
    (["scheduler=cosine", "trainer.max_steps=4"], "scheduler.warmup_epochs=1.0: a warm-up of 22 steps passes the run"),
    # Hydra would write .hydra/ before any check, over a finished run's.
    (["hydra.output_subdir=.hydra"], "hydra.output_subdir=.hydra: Hydra would write the config there before any"),
    (["trainer.replica_check_every_n_steps=-1"], "trainer.replica_check_every_n_steps=-1: must be 0 (off), positive"),
    # Every job of a sweep, before the first runs.
    (["-m", "optimizer.lr=0.1,abc,0.01"], "optimizer.lr=abc: must be a positive finite number (in the sweep's job"),
    # A search space, direction or budget that Optuna or joblib would refuse.
    (
        ["-m", "hparams_search=mnist1d_optuna", "hydra.sweeper.params.optimizer.lr=interval(1e-2, 1e-4)"],
        "Optuna refuses it",
    ),
    (
        ["-m", "hparams_search=mnist1d_optuna", "hydra.sweeper.n_trials=0"],
        "hydra.sweeper.n_trials=0: must be a positive",
    ),
    (["-m", "hparams_search=mnist1d_optuna", "hydra.sweeper.direction=maximise"], "must be minimize or maximize"),
    (["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=0", "seed=0,1"], "hydra.launcher.n_jobs=0: jobs at once"),
    # What escaped hydraloop's handler as Hydra's "Error executing job".
    (["logger=wandb", "+logger.project=x"], "logger.project=x: not a logger"),
    (["+logger.tensorboard.flush_sec=5"], "TensorBoardLogger takes no argument 'flush_sec'"),
    (["logger=mlflow", "logger.mlflow.tags=baseline"], "logger.mlflow.tags=baseline: must be a mapping"),
    (["logger=wandb", "logger.wandb.tags=baseline"], "logger.wandb.tags=baseline: must be a list, e.g. [baseline]"),
    (["logger=wandb", "logger.wandb.mode=offlin"], "logger.wandb.mode=offlin: must be one of online, offline"),
    # A Hugging Face model: a key its config lacks (a +, since model.config starts empty), a folder that is not there.
    (["model=hf", "model.config.n_layer=2"], "a key it lacks is added with a +: +model.config.n_layer=..."),
    (["model=hf", "model.name_or_path=someone/no-gpt"], "not a local folder, and not in the Hugging Face cache"),
    # What only a rank used to find, after the config dump: now the launcher, before any rank starts.
    (["parallel=ddp", "data.batch_size=2048"], "data.batch_size=2048: more than the training set's 1438 samples"),
    (["parallel=ddp", "data.dataset.val_fraction=1.5"], "data.dataset.val_fraction=1.5: must be between 0 and 1"),
    (["experiment=text_gpt", "data.dataset.path=SHORT_TEXT"], "data.block_size=64: the train split of"),
    # Structured batches: a leaf that is not a tensor, a dict without the targets, a model output no task can read.
    (
        [
            "data.dataset._target_=tests.structured.with_text",
            "model._target_=tests.structured.Keyword",
            "~model.input_shape",
            "~model.num_classes",
            "~model.hidden_sizes",
            "~model.dropout",
        ],
        "batch['text'] of a batch is a list",
    ),
    (
        [
            "data.dataset._target_=tests.structured.without_labels",
            "model._target_=tests.structured.Keyword",
            "~model.input_shape",
            "~model.num_classes",
            "~model.hidden_sizes",
            "~model.dropout",
        ],
        "the batch is a dict of 'x', 'target', without 'labels'",
    ),
    (
        ["model._target_=tests.structured.TupleOut"],
        "the model returns a tuple; Classification reads a tensor of outputs",
    ),
    # Callbacks: one that does not exist, a value out of range, a metric no callback reports, weights for training.
    (["callbacks=[ema,swa]"], "callbacks=[ema,swa]: 'swa' is not an option of callbacks (ema, grad_norm)"),
    (["callbacks=[ema]", "callbacks.ema.decay=1.5"], "callbacks.ema.decay=1.5: must be in (0, 1)"),
    (["callbacks=[ema]", "callbacks.ema.every_n_steps=0"], "callbacks.ema.every_n_steps=0: must be >= 1"),
    (["callbacks=[ema]", "+callbacks.ema.decay_rate=0.9"], "EMA takes no argument 'decay_rate'"),
    (["+callbacks.ema.decay=0.9"], "callbacks.ema={'decay': 0.9}: not a callback"),
    (["callbacks=[grad_norm]", "callbacks.grad_norm.norm_type=0"], "callbacks.grad_norm.norm_type=0: must be positive"),
    (["optimized_metric=val/ema/acc"], "optimized_metric=val/ema/acc: the task reports val/loss, val/acc"),
    (["ckpt_weights=ema"], "ckpt_weights=ema: for mode=eval and mode=predict"),
    (["parallel=fsdp", "parallel.replicate=3"], "parallel.replicate=3: must divide the world size, 2 ranks"),
    (["trainer.activation_checkpointing=[Blok]"], "trainer.activation_checkpointing=['Blok']: Blok is no module class"),
    (["trainer.activation_checkpointing=true"], "trainer.activation_checkpointing=true: MLP names no blocks"),
    (
        ["trainer.activation_checkpointing=Block"],
        "trainer.activation_checkpointing=Block: must be true, false or a list",
    ),
    # Tracebacks from constructors and launchers.
    (["model.hidden_sizes=256"], "model.hidden_sizes=256: must be a list, e.g. [256] (hydraloop.models.mlp.MLP)"),
    (["model=gpt", "data=text", "task=language_model", "model.n_layer=2.5"], "model.n_layer=2.5: must be an integer"),
    (["data=mnist1d", "data.dataset.cache_dir=A_FILE/cache"], "data.dataset.cache_dir=A_FILE/cache: cannot be written"),
    (["hydra.run.dir=A_FILE/run"], "hydra.run.dir=A_FILE/run: A_FILE is a file, not a folder"),
    (["logger=mlflow", "logger.mlflow.tracking_uri=sqlite:///A_FILE/mlflow.db"], "cannot make the database in A_FILE"),
    # A model that cannot take the data, or a metric the task's outputs (hydraloop.trial): each used to train until
    # the first step or validation, then end in a traceback. A model family on data it cannot take:
    (
        ["model=torchvision"],
        "model=torchvision cannot take data=digits's inputs, float32 [2, 1, 8, 8] (data.input_shape=[1, 8, 8]): "
        "Given groups=1, weight of size [64, 3, 7, 7], expected input[2, 1, 8, 8] to have 3 channels",
    ),
    (["model=timm", "data=synthetic"], "model=timm cannot take data=synthetic's inputs, float32 [2, 32]"),
    (["model=hf", "model.model_type=gpt2"], "model=hf cannot take data=digits's inputs, float32 [2, 1, 8, 8]"),
    (["model=gan"], "model=gan cannot take data=digits's inputs, float32 [2, 1, 8, 8]"),
    (["model=gpt"], "model.vocab_size=None: must be a positive integer (data=text sets data.vocab_size)"),
    (["model=mlp", "data=text", "task=language_model"], "model=mlp cannot take data=text's inputs, int64 [2, 256]"),
    (["model=cnn", "data=text", "task=language_model"], "model=cnn cannot take data=text's inputs, int64 [2, 256]"),
    (["experiment=ring_gan", "model=mlp"], "task=adversarial_ring with model=mlp fails on data=ring's batch"),
    (
        ["data=text", "task=language_model", *TINY_HF, "model.auto_class=AutoModelForSequenceClassification"],
        "model=hf cannot take data=text's inputs, int64 [2, 256] (data.input_shape=[256]): Cannot handle batch sizes",
    ),
    # A metric, any torchmetrics class, that cannot take a task's outputs; one computing a number per class.
    (
        ["+metrics.f1={_target_: torchmetrics.classification.BinaryF1Score}"],
        "metrics.f1 (BinaryF1Score) cannot take task=classification's outputs, predictions float32 [10, 10] and",
    ),
    (
        ["+metrics.mse={_target_: torchmetrics.MeanSquaredError}"],
        "metrics.mse (MeanSquaredError, num_outputs=1) cannot take task=",
    ),
    (
        ["+metrics.f1={_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 5}"],
        "metrics.f1 (MulticlassF1Score, num_classes=5) cannot take task=classification's outputs",
    ),
    (
        ["+metrics.f1={_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 5, validate_args: false}"],
        "metrics.f1 (MulticlassF1Score, num_classes=5) cannot take",
    ),  # the stand-in targets hold all 10 classes
    (
        ["task=regression", "data=diabetes", "+metrics.acc={_target_: torchmetrics.classification.BinaryAccuracy}"],
        "metrics.acc (BinaryAccuracy) cannot take task=regression's outputs, predictions float32 [2] and targets",
    ),
    (
        ["+metrics.f1={_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10, average: null}"],
        "metrics.f1 (MulticlassF1Score, num_classes=10): computes a tensor of shape [10]",
    ),
    (
        ["+metrics.acc={_target_: torchmetrics.classification.MulticlassAccuracy, num_classes: 10}"],
        "metrics.acc: val/acc is the task's own metric, which it would overwrite",
    ),
    # Labels past data.num_classes: the trial's two rows hold 0 and 1; the whole training set, in memory, is read.
    (["data.num_classes=5"], "data.num_classes=5: the training set's labels run from 0 to 9, outside [0, 5)"),
    # Messages that named the wrong thing, or advised what is refused next.
    (["optimizer.learning_rate=0.01"], "optimizer has no key 'learning_rate'; did you mean optimizer.lr?"),
    (["trainer.ckpt_path=/a/last.pt"], "trainer has no key 'ckpt_path'; did you mean ckpt_path, at the top level?"),
    (["model.lr=0.1"], "model has no key 'lr'; did you mean optimizer.lr?"),
    (
        ["-m", SEARCH, "hydra.sweeper.params.optimizer.lrr=interval(1e-4,1e-2)"],
        "the config has no key optimizer.lrr, and a search key is given on the command line as itself, not under "
        "hydra.sweeper.params: did you mean optimizer.lr=interval(1e-4,1e-2)?",
    ),
    (["-m", SEARCH, "optimizer.lrr=interval(1e-4,1e-2)"], "the config has no key optimizer.lrr; did you mean optim"),
    ([*TENSORS, "data.dataset.path=NOT_NPZ"], "not a .npz file (a zip of .npy arrays, as np.savez writes)"),
    (["model=hf", "model.name_or_path=EMPTY_DIR"], "model.name_or_path=EMPTY_DIR: the folder has no config.json"),
]
TENSOR_FILES = [
    ({"x": np.zeros((10, 3), np.float32), "y": np.arange(10)}, "'y' holds labels from 0 to 9, outside [0,"),
    ({"x": np.zeros((10, 3), np.float32), "y": np.arange(10), "regression": True}, "integer labels; data.target_shape"),
    ({"x": np.zeros((10, 3), np.float32), "y": np.eye(10, 3)}, "labels must be integer class indices"),
    ({"x": np.full((10, 3), np.nan, np.float32), "y": np.zeros(10, np.int64)}, "'x' holds 30 NaN or infinite"),
]


@pytest.fixture
def made(tmp_path):
    """Files the rows name: a short text, a file in the way of a folder."""
    (tmp_path / "short.txt").write_text("hello")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "not.npz").write_bytes(b"not a zip")
    (tmp_path / "empty").mkdir()
    named = {"SHORT_TEXT": "short.txt", "A_FILE": "a-file", "NOT_NPZ": "not.npz", "EMPTY_DIR": "empty"}
    return {name: str(tmp_path / file) for name, file in named.items()}


def substituted(items: list[str], made: dict[str, str]) -> list[str]:
    for name, value in made.items():
        items = [item.replace(name, value) for item in items]
    return items


def assert_refused_before_anything(run, expected: str, sweep_dir: Path) -> None:
    assert expected in bad_input_line(run), run.output
    assert not run.run_dir.exists(), list(run.run_dir.rglob("*"))  # not even the empty folder Hydra made
    assert not sweep_dir.exists()


@pytest.mark.parametrize("overrides, expected", ROWS, ids=[" ".join(row[0]) for row in ROWS])
def test_a_mistake_is_one_line_and_writes_nothing(run_refused, tmp_path, made, overrides, expected):
    sweep_dir = tmp_path / "new" / "sweep"
    overrides, expected = substituted(overrides, made), substituted([expected], made)[0]
    run = run_refused(*overrides, f"hydra.sweep.dir={sweep_dir}", run_dir=tmp_path / "new" / "run")
    assert_refused_before_anything(run, expected, sweep_dir)
    assert not (tmp_path / "new").exists()  # nor the folders above it that Hydra made for it


@pytest.mark.parametrize("arrays, expected", TENSOR_FILES)
def test_a_tensors_file_is_checked_in_the_launcher(run_refused, tmp_path, arrays, expected):
    path = tmp_path / "data.npz"
    regression = (
        ("task=regression", "data.target_shape=[]", "data.num_classes=1") if arrays.pop("regression", 0) else ()
    )
    np.savez(path, **arrays)
    run = run_refused(*TENSORS, *regression, f"data.dataset.path={path}", "parallel=ddp", run_dir=tmp_path / "run")
    assert_refused_before_anything(run, expected, tmp_path / "sweep")
    assert "[rank " not in run.output


def test_a_pt_file_that_needs_unpickling_says_why_without_escapes(run_refused, tmp_path):
    path = tmp_path / "data.pt"
    torch.save({"x": torch.zeros(4, 3), "y": torch.arange(4), "note": object()}, path)
    run = run_refused(*TENSORS, f"data.dataset.path={path}", run_dir=tmp_path / "run")
    assert_refused_before_anything(run, "it holds more than tensors", tmp_path / "sweep")
    assert "\x1b[" not in run.output


def test_an_experiment_file_that_cannot_compose_is_one_line(train_env, tmp_path):
    """A copy of the entrypoint and conf/, with three broken experiments: a misspelt option in its defaults, no
    package header, and not YAML."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    (tmp_path / "src").mkdir()
    shutil.copy(TRAIN, tmp_path / "src" / "train.py")
    experiments = tmp_path / "conf" / "experiment"
    (experiments / "misspelt.yaml").write_text("# @package _global_\ndefaults:\n  - override /scheduler: cosin\n")
    (experiments / "headless.yaml").write_text("trainer:\n  max_epochs: 3\n")
    (experiments / "broken.yaml").write_text("# @package _global_\ntrainer:\n  max_epochs: [3\n")
    (experiments / "typo.yaml").write_text("# @package _global_\ntrainer:\n  max_epchs: 3\n")
    (experiments / "wrong.yaml").write_text("# @package _global_\ntrainer:\n  max_epochs: abc\n")
    cases = {
        # The file's value is named, not the valid one the command line gives after it.
        "wrong trainer.max_epochs=1": "trainer.max_epochs=abc (set in experiment=wrong): must be an integer",
        "typo": "trainer.max_epchs (set in experiment=typo): trainer has no key 'max_epchs'; did you mean",
        "misspelt": "its defaults name scheduler: cosin, not an option of scheduler (constant, cosine, step)",
        "headless": "experiment=headless: the file must begin with '# @package _global_'",
        "broken": f"{experiments / 'broken.yaml'}, line 3: not valid YAML",
    }
    for case, expected in cases.items():
        name, *more = case.split()
        command = [sys.executable, str(tmp_path / "src" / "train.py"), f"experiment={name}", *more]
        proc = subprocess.run(command, cwd=tmp_path, env=train_env, capture_output=True, text=True, timeout=120)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stdout + proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_an_image_size_of_no_pixels_is_one_line(run_refused, image_folder, tmp_path):
    """It used to escape hydraloop's handler as Hydra's "Error executing job" from the folder's launcher check."""
    overrides = ("data=image_folder", f"data.dataset.root={image_folder}", "data.image_size=0", "model=cnn")
    run = run_refused(*overrides, run_dir=tmp_path / "run")
    assert_refused_before_anything(run, "data.input_shape=[3, 0, 0]: must be positive sizes", tmp_path / "sweep")


def test_a_rank_whose_peers_never_come_ends_in_one_line(train_env, tmp_path):
    """Rank 1 of 2, started alone: no rank 0 answers at MASTER_ADDR:MASTER_PORT within parallel.timeout_s."""
    environment = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    environment["MASTER_PORT"] = str(free_port())
    command = [sys.executable, str(TRAIN), "parallel=ddp", "parallel.timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, env={**train_env, **environment}, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "[ERROR]" in line]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in output and "frame #" not in output, output
    assert "rank 1 of 2: the process group did not form at 127.0.0.1:" in errors[0]
    assert "within parallel.timeout_s=3" in errors[0]


def test_predicting_fewer_inputs_than_ranks_is_refused_in_the_launcher(run_refused, tmp_path, classifier):
    path = tmp_path / "one.npz"
    np.savez(path, x=np.zeros((1, 1, 8, 8), np.float32))
    overrides = ("mode=predict", f"ckpt_path={classifier}", f"data.predict_path={path}", "parallel=ddp")
    run = run_refused(*overrides, run_dir=tmp_path / "run")
    assert_refused_before_anything(run, "1 input(s), fewer than the 2 ranks", tmp_path / "sweep")


def test_an_evaluation_into_a_training_runs_checkpoints_folder_is_refused(run_refused, classifier):
    folder = classifier.parent
    before = sorted(path.name for path in folder.iterdir())
    run = run_refused("mode=eval", f"ckpt_path={classifier}", run_dir=folder)
    assert "holds a training run's records" in bad_input_line(run)
    assert sorted(path.name for path in folder.iterdir()) == before


def test_a_truncated_last_checkpoint_names_resume_and_how_to_start_over(run_train, run_refused, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train("trainer.max_epochs=1", "trainer.keep_last_k=1", "logger=none", run_dir=run_dir)
    assert first.returncode == 0, first.output
    for path in (run_dir / "checkpoints").glob("*.pt"):
        path.write_bytes(path.read_bytes()[:100])
    error = bad_input_line(run_refused("trainer.max_epochs=2", "logger=none", run_dir=run_dir))
    assert f"resume=true: {run_dir / 'checkpoints' / 'last.pt'}: not a readable checkpoint" in error
    assert error.endswith("(resume=false starts the run directory over)")


@pytest.fixture(scope="module")
def language_model(run_train):
    """A tiny GPT's checkpoint, trained one step on data=text's characters."""
    sizes = ("model.n_layer=1", "model.n_head=2", "model.n_embd=16", "data.block_size=16", "data.batch_size=8")
    run = run_train("model=gpt", "data=text", "task=language_model", *sizes, "trainer.max_steps=1", "logger=none")
    assert run.returncode == 0, run.output
    return run.run_dir / "checkpoints" / "last.pt"


def test_predicting_with_a_checkpoint_of_another_task_and_data_names_them(run_refused, tmp_path, language_model):
    """It blamed a tokenizer mismatch (char against byte): every data config looked like byte-level text."""
    path = tmp_path / "digits.npz"
    np.savez(path, x=np.zeros((4, 1, 8, 8), np.float32))
    run = run_refused(
        "mode=predict", f"ckpt_path={language_model}", f"data.predict_path={path}", run_dir=tmp_path / "r"
    )
    expected = f"ckpt_path={language_model}: was trained for task=language_model on data=text, and this run is "
    assert_refused_before_anything(run, expected + "task=classification on data=digits", tmp_path / "sweep")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """(a data=hf csv of labelled lines, a byte-level BPE tokenizer.json with a <pad> token, trained on them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("texts")
    lines = [f"line {index} of a {'short' if index % 2 else 'longer'} text" for index in range(40)]
    (folder / "texts.csv").write_text("text,label\n" + "".join(f"{line},{i % 2}\n" for i, line in enumerate(lines)))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(special_tokens=["<pad>"], initial_alphabet=alphabet))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "texts.csv", folder / "tokenizer.json"


def test_a_json_file_that_does_not_parse_is_said_once_with_the_parsers_words(run_refused, tmp_path, texts):
    """datasets logged its own error twice before hydraloop's line, which said only that generating failed."""
    path = tmp_path / "broken.json"
    path.write_text('{"text": "a", "label": 0')
    _, tokenizer = texts
    hf = ("data=hf", f"data.dataset.path={path}", "data.num_classes=2", f"data.dataset.tokenizer={tokenizer}")
    run = run_refused(*hf, "data.dataset.pad_token='<pad>'", *TINY_HF, run_dir=tmp_path / "run")
    expected = f"data.dataset.path={path}: cannot be read as a data set (JSON parse error: Missing a comma"
    assert_refused_before_anything(run, expected, tmp_path / "sweep")
    assert len([line for line in run.output.splitlines() if line.strip()]) == 1, run.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_nccl_on_a_machine_without_gpus_names_the_backend_and_gloo(run_refused, tmp_path):
    """It named parallel.nproc_per_node=2, a default the command line did not set."""
    run = run_refused("parallel=ddp", "parallel.backend=nccl", run_dir=tmp_path / "run")
    expected = "parallel.backend=nccl: NCCL reduces CUDA tensors, and this run computes on the CPU (no GPU is visible)"
    assert_refused_before_anything(run, expected + "; parallel.backend=gloo reduces CPU tensors", tmp_path / "sweep")


def test_a_cache_home_that_cannot_be_written_is_named_by_its_variable(train_env, tmp_path):
    (tmp_path / "a-file").write_text("")
    command = [sys.executable, str(TRAIN), "data=mnist1d", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**train_env, "XDG_CACHE_HOME": str(tmp_path / "a-file")}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stdout.splitlines() if "[ERROR]" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout
    assert (
        f"XDG_CACHE_HOME={tmp_path / 'a-file'}: the data cache under it, {tmp_path / 'a-file'}/hydraloop," in errors[0]
    )
    assert not (tmp_path / "run").exists()


def test_a_model_failing_in_a_ranks_first_step_is_one_line_naming_it(run_refused, tmp_path):
    """What the launcher's trial batch of two rows cannot see (hydraloop.trial): the model's first call in a rank,
    on data.batch_size rows, names the model, its inputs and the line that failed, not a traceback."""
    run = run_refused("model._target_=tests.structured.TwoRows", run_dir=tmp_path / "run")
    error = bad_input_line(run)
    assert (
        "model._target_=tests.structured.TwoRows cannot take the first batch's inputs, float32 [64, 1, 8, 8]: " in error
    )
    assert "mat1 and mat2 shapes cannot be multiplied (2x2048 and 64x128) (at " in error


ALONE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({"WORLD_SIZE": "3"}, "WORLD_SIZE=3: set without RANK and LOCAL_RANK"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, "MASTER_PORT=abc: must be an"),
        (
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x", "MASTER_PORT": "70000"},
            "must be a port",
        ),
        ({**ALONE, "MASTER_PORT": "29500"}, "MASTER_ADDR not set, beside RANK=0 and WORLD_SIZE=1"),
    ],
)
def test_a_launchers_variables_that_cannot_be_are_one_line(train_env, tmp_path, environment, expected):
    command = [sys.executable, str(TRAIN), "parallel=ddp", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, env={**train_env, **environment}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert expected in proc.stdout
    assert not (tmp_path / "run").exists()


def test_garbage_in_omp_num_threads_is_ignored_with_one_warning_and_each_rank_keeps_its_share(run_train, train_env):
    env = {**train_env, "OMP_NUM_THREADS": "abc"}
    command = [sys.executable, str(TRAIN), "parallel=ddp", "trainer.max_epochs=1", "logger=none"]
    proc = subprocess.run([*command, "hydra.run.dir=/tmp/omp-garbage"], env=env, capture_output=True, text=True)
    shutil.rmtree("/tmp/omp-garbage", ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "[WARNING]" in line and "OMP_NUM_THREADS" in line]
    assert len(warnings) == 1 and "ignored: each rank computes with its share of the cores" in warnings[0]


SCRIPT_ROWS = [
    (["benchmark.py", "--repeats", "0"], "--repeats 0: must be at least 1"),
    (["benchmark.py", "--ddp-procs", "0"], "--ddp-procs 0: must be at least 1"),
    (["benchmark.py", "--device", "cuda"], "--device cuda: CUDA is not available"),
    (["benchmark.py", "--out", "A_FILE/benchmark.json"], "--out A_FILE: A_FILE is a file, not a folder"),
    (["summarize.py", "SWEEP", "--out", "A_FILE"], "--out A_FILE: A_FILE is a file, not a folder"),
    (["make_image_folder.py", "A_FILE"], "A_FILE: a file, not a folder"),
    (["sample.py", "CLASSIFIER"], "is not a language model with a generate method"),
    (["prepare_text.py", "SHORT_TEXT.missing", "NEW_FOLDER"], "SOURCE SHORT_TEXT.missing: no such file or folder"),
    (["prepare_text.py", "SHORT_TEXT", "A_FILE"], "OUT A_FILE: exists and is not a prepared folder"),
    (["prepare_text.py", "SHORT_TEXT", "NEW_FOLDER", "--tokenizer", "A_FILE.json"], "--tokenizer A_FILE.json: neither"),
    (
        ["prepare_text.py", "SHORT_TEXT", "NEW_FOLDER", "--vocab-size", "300"],
        "--vocab-size 300: only for --tokenizer bpe",
    ),
    (["prepare_text.py", "SHORT_TEXT", "NEW_FOLDER", "--tokenizer", "bpe"], "--vocab-size None: --tokenizer bpe needs"),
    (
        ["prepare_text.py", "SHORT_TEXT", "NEW_FOLDER", "--val-fraction", "1"],
        "--val-fraction 1.0: must be between 0 and 1",
    ),
]


@pytest.fixture(scope="module")
def classifier(run_train):
    run = run_train("trainer.max_epochs=1", "logger=none")
    assert run.returncode == 0, run.output
    return run.run_dir / "checkpoints" / "last.pt"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --device cuda row needs a machine without CUDA")
@pytest.mark.parametrize("args, expected", SCRIPT_ROWS, ids=[" ".join(row[0]) for row in SCRIPT_ROWS])
def test_a_helper_scripts_mistake_is_one_line_and_exit_2(train_env, tmp_path, made, classifier, args, expected):
    (tmp_path / "sweep").mkdir()
    made = {
        **made,
        "SWEEP": str(tmp_path / "sweep"),
        "CLASSIFIER": str(classifier),
        "NEW_FOLDER": str(tmp_path / "out"),
    }
    script, *rest = substituted(args, made)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *rest], env=train_env, capture_output=True, text=True
    )
    errors = [line for line in proc.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
    assert substituted([expected], made)[0] in errors[0]
    assert not (tmp_path / "out").exists()


def test_make_image_folder_writes_into_an_empty_folder(train_env, tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_image_folder.py"), str(root)], env=train_env, capture_output=True
    )
    assert proc.returncode == 0 and b"written" in proc.stdout
    assert len(list((root / "train").glob("*/*.png"))) == 1438
