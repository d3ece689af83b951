"""mode=predict: a checkpoint's model over a file of inputs, in the file's order, the same under every strategy."""

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from conftest import bad_input_line, read_checkpoint


@pytest.fixture(scope="module")
def trained(run_train):
    run = run_train("trainer.max_epochs=1", "logger=none")
    assert run.returncode == 0, run.output
    return run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "new.npz"
    np.savez(path, x=np.random.default_rng(0).random((37, 1, 8, 8), dtype=np.float32))  # 37: shards of 19 and 18
    return path


def predictions(run_dir) -> dict[str, np.ndarray]:
    with np.load(run_dir / "predictions.npz") as arrays:
        return dict(arrays)


def test_predictions_are_the_models_outputs_in_input_order(train_in_process, trained, inputs):
    ckpt = trained.run_dir / "checkpoints" / "last.pt"
    summary, run_dir = train_in_process("mode=predict", f"ckpt_path={ckpt}", f"data.predict_path={inputs}")
    checkpoint = read_checkpoint(ckpt)
    model = instantiate(checkpoint["config"]["model"])
    model.load_state_dict(checkpoint["model"])
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(np.load(inputs)["x"]))
    found = predictions(run_dir)
    assert set(found) == {"class", "probabilities"} and summary["num_predictions"] == 37
    assert np.array_equal(found["class"], logits.argmax(dim=1).numpy())
    np.testing.assert_allclose(found["probabilities"], logits.softmax(dim=1).numpy(), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_predictions_under_every_strategy_equal_singles(run_train, trained, inputs, parallel):
    ckpt = f"ckpt_path={trained.run_dir / 'checkpoints' / 'last.pt'}"
    single = run_train("mode=predict", ckpt, f"data.predict_path={inputs}")
    sharded = run_train("mode=predict", ckpt, f"data.predict_path={inputs}", f"parallel={parallel}")
    assert single.returncode == 0 and sharded.returncode == 0, single.output + sharded.output
    expected, found = predictions(single.run_dir), predictions(sharded.run_dir)
    assert np.array_equal(found["class"], expected["class"])
    np.testing.assert_allclose(found["probabilities"], expected["probabilities"], rtol=1e-6)


def test_regression_predictions_have_the_targets_shape(train_in_process, tmp_path):
    _, run_dir = train_in_process("experiment=diabetes_mlp", "trainer.max_epochs=1", "logger=none")
    np.savez(tmp_path / "patients.npz", x=np.zeros((5, 10), dtype=np.float32))
    _, predicted = train_in_process(
        "experiment=diabetes_mlp",
        "mode=predict",
        f"ckpt_path={run_dir}/checkpoints/last.pt",
        f"data.predict_path={tmp_path / 'patients.npz'}",
    )
    found = predictions(predicted)
    assert list(found) == ["prediction"] and found["prediction"].shape == (5,)
    assert np.all(found["prediction"] == found["prediction"][0])  # the same input, the same prediction


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda path: np.savez(path, x=np.zeros((4, 64), dtype=np.float32)),
            "'x' samples have shape [64], but data.input_shape=[1, 8, 8]",
        ),
        (lambda path: np.savez(path, inputs=np.zeros((4, 1, 8, 8))), "no 'x' in the file; it holds inputs"),
    ],
)
def test_a_prediction_file_that_does_not_fit_is_refused(run_train, trained, tmp_path, make, message):
    path = tmp_path / "bad.npz"
    make(path)
    run = run_train(
        "mode=predict", f"ckpt_path={trained.run_dir / 'checkpoints' / 'last.pt'}", f"data.predict_path={path}"
    )
    assert f"data.predict_path={path}: {message}" in bad_input_line(run)
    assert not (run.run_dir / "predictions.npz").exists()


def test_predict_needs_its_file(run_train, trained):
    run = run_train("mode=predict", f"ckpt_path={trained.run_dir / 'checkpoints' / 'last.pt'}")
    assert "mode=predict: needs data.predict_path=<.npz or .pt file holding x, the inputs>" in bad_input_line(run)
