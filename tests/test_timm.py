"""model=timm: a timm model by name, pretrained weights from the Hugging Face cache or a file (never downloaded),
a fresh head for another num_classes, timm's data config in the config; what it cannot build is one line."""

import subprocess
import sys

import pytest
import torch

from conftest import TRAIN, Run, bad_input_line, compose_train, max_param_diff
from hydraloop.errors import ConfigError

timm = pytest.importorskip("timm", reason="the timm extra (in dev)")
from safetensors.torch import save_file  # noqa: E402  (a dependency of timm's)

from hydraloop.models.timm_model import timm_model  # noqa: E402

NAME = "test_resnet.r160_in1k"  # timm's own tiny test network, with a Hugging Face repo of weights


def imagenet_weights(path):
    """What an offline machine would have copied: a file of the model's ImageNet-sized state."""
    torch.manual_seed(12345)  # not the run's seed: its own initialisation would be these very weights
    state = timm.create_model(NAME, num_classes=1000).state_dict()
    save_file(state, str(path))
    return state


def body(state: dict) -> dict:
    return {key: value for key, value in state.items() if not key.startswith("fc.")}


def test_a_weights_file_loads_and_another_num_classes_gets_a_fresh_head(tmp_path):
    saved = imagenet_weights(tmp_path / "weights.safetensors")
    model = timm_model(NAME, num_classes=10, weights_file=str(tmp_path / "weights.safetensors"))
    assert model.fc.weight.shape == (10, saved["fc.weight"].shape[1])
    assert max_param_diff(body(model.state_dict()), body(saved)) == 0.0


def test_pretrained_weights_come_from_the_hugging_face_cache_or_one_line(train_env, image_folder, tmp_path):
    env = {**train_env, "HF_HOME": str(tmp_path / "hf")}

    def train(run_dir):
        command = [sys.executable, str(TRAIN), f"hydra.run.dir={run_dir}", "model=timm", f"model.name={NAME}"]
        command += ["model.pretrained=true", "data=image_folder", f"data.dataset.root={image_folder}", "logger=none"]
        command += ["data.image_size=32", "data.batch_size=8", "data.num_workers=0", "trainer.max_steps=2"]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
        return Run(proc.returncode, proc.stdout + proc.stderr, run_dir)

    missing = train(tmp_path / "missing")
    expected = f"{NAME}'s weights (timm/{NAME}, model.safetensors) are not in the Hugging Face cache"
    assert expected in bad_input_line(missing) and not (tmp_path / "missing").exists()
    # The cache's own layout, as `hf download timm/test_resnet.r160_in1k` leaves it.
    repo = tmp_path / "hf" / "hub" / f"models--timm--{NAME}"
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    saved = imagenet_weights(repo / "snapshots" / "0123abcd" / "model.safetensors")
    found = train(tmp_path / "found")
    assert found.returncode == 0, found.output
    trained = found.checkpoint()["model"]
    assert trained["fc.weight"].shape[0] == 10  # the digits' classes: a fresh head
    # Two AdamW steps of lr 3e-3 from the cached weights move each weight by about 6e-3 at most; a fresh start, far.
    convolutions = [key for key in trained if "conv" in key and key.endswith("weight")]
    assert max((trained[key] - saved[key]).abs().max().item() for key in convolutions) < 7e-3


def test_timms_data_config_resolves_in_the_config():
    cfg = compose_train("model=timm", f"model.name={NAME}", f"+mean=${{timm_data:{NAME},mean}}")
    assert cfg.mean == [0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({"name": "resnet181"}, "model.name=resnet181: not a timm model; closest: resnet18"),
        ({"name": "resnet18", "weights_file": "/nowhere.safetensors"}, "model.weights_file=/nowhere.safetensors"),
        ({"name": "resnet18.a1_in1kk"}, "model.name=resnet18.a1_in1kk: timm has no weights tagged 'a1_in1kk'; closest"),
        ({"name": "resnet18", "drop_rat": 0.2}, "model.name=resnet18: .*unexpected keyword argument 'drop_rat'"),
    ],
)
def test_what_it_cannot_build_is_one_line(arguments, expected):
    with torch.device("meta"), pytest.raises(ConfigError, match=expected):
        timm_model(num_classes=10, **arguments)


# A ViT of 2 blocks on the digits' 8x8 images, with every kind of timm randomness: dropout, attention dropout,
# projection dropout and drop path (stochastic depth).
TINY_VIT = ["model=timm", "model.name=vit_tiny_patch16_224", "+model.img_size=8", "+model.patch_size=4"]
TINY_VIT += ["+model.embed_dim=16", "+model.depth=2", "+model.num_heads=2", "+model.drop_path_rate=0.3"]
TINY_VIT += ["+model.attn_drop_rate=0.1", "+model.proj_drop_rate=0.1", "+model.drop_rate=0.1", "logger=none"]
TINY_VIT += ["data.batch_size=24", "data.drop_last=false", "trainer.limit_train_samples=53", "trainer.max_steps=5"]


@pytest.mark.slow
def test_timms_dropout_and_drop_path_are_keyed_so_ddp_with_accumulation_trains_what_single_does(run_train):
    single = run_train(*TINY_VIT)
    split = run_train(*TINY_VIT, "parallel=ddp", "trainer.grad_accum_steps=2")  # a last batch of 5 rows
    for run in (single, split):
        assert run.returncode == 0, run.output
    assert "not exact" not in split.log and "nn.Dropout" not in split.log
    assert max_param_diff(single.checkpoint()["model"], split.checkpoint()["model"]) < 1e-5
