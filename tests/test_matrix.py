"""The feature matrix: every pair of values of the axes below in at least one case (an all-pairs covering array,
tests/covering_array.py), and each case compared with a single-process run (hydraloop.exactness). A new feature is a
new value on an axis: it is crossed with every other value the day it lands.

Every case trains 5 steps of tiny models on batches of 12 over epochs of 29 samples (trainer.limit_train_samples):
2 batches and one of 5 rows, fewer than 2 ranks x 3 micro-batches. A reference is one single-process run per model
and precision, with callbacks=[ema] and trainer.eval_best=true (neither changes the training): a case without them
may lack their entries (`lacking`), and nothing else. Combinations that do not apply (Hugging Face's gradient
checkpointing on an MLP) are left out; combinations hydraloop refuses are left out of the cases and each asserted as
its one-line refusal.

Past 300 lines because it is one array: each axis value's command and what its cases compare stand beside the axes.
"""

import fnmatch
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import REPO, bad_input_line
from covering_array import covering_array, uncovered_pairs
from hydraloop.checkpoint import load_checkpoint
from hydraloop.exactness import TOLERANCES, compare, compare_entries, table
from hydraloop.final_state import final_state
from hydraloop.precision import Precision
from hydraloop.predict import load_inputs

AXES = {
    "model": ["mlp", "gpt", "gpt2_lora", "opt", "gan", "simclr"],
    "strategy": ["single", "ddp", "fsdp", "fsdp_noreshard", "hsdp"],
    "recompute": ["none", "activation_checkpointing", "hf_gradient_checkpointing"],
    "checkpoint": ["full", "sharded", "async"],
    "evaluation": ["none", "eval_best", "ema_eval", "ema_predict"],
    "accumulation": [1, 3],
    "precision": ["32", "bf16"],
    "callbacks": ["none", "ema"],
    "resume": ["none", "stop_resume"],
}

# Tokens a sample. GPT-2's pass 2 x hydraloop.keyed_attention.BLOCK: its attention with dropout runs a block of
# queries at a time; OPT's take the explicit attention.
BLOCKS = {"gpt": 16, "gpt2_lora": 264, "opt": 16}
TEXT = ["data=text", "task=language_model"]
MODELS = {
    "mlp": ["data=synthetic", "data.input_shape=[8]", "data.num_classes=4", "model=mlp", "model.hidden_sizes=[16]"]
    + ["model.dropout=0.1"],
    "gpt": [*TEXT, "data.block_size=16", "model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=16"]
    + ["model.dropout=0.1"],
    # transformers' own dropout settings (0.1), keyed; peft's LoRA adapters on its attention and projections (its
    # Conv1D layers), their dropout keyed too, the model frozen.
    "gpt2_lora": [*TEXT, "data.block_size=264", "model=hf", "model.model_type=gpt2", "+model.config.n_layer=1"]
    + ["+model.config.n_embd=16", "+model.config.n_head=2", "+model.config.n_positions=264"]
    + ["model.lora={r: 4, alpha: 8, dropout: 0.1, target_modules: [c_attn, c_proj]}"],
    "opt": [*TEXT, "data.block_size=16", "model=hf", "model.model_type=opt", "+model.config.num_hidden_layers=1"]
    + ["+model.config.hidden_size=16", "+model.config.word_embed_proj_dim=16", "+model.config.num_attention_heads=2"]
    + ["+model.config.ffn_dim=32", "+model.config.max_position_embeddings=32"],
    "gan": ["experiment=ring_gan", "model.hidden_sizes=[16]"],
    # A loss over the global batch (gathered; two passes under accumulation), views drawn with keyed_random, and
    # keyed dropout over a batch of each row's two views. best.pt by the loss: the nearest neighbours of val/knn_acc
    # may rightly flip at a near tie in bf16, and with them the best step.
    "simclr": ["experiment=digits_simclr", "model.hidden_sizes=[16]", "model.num_classes=8", "model.dropout=0.1"]
    + ["optimized_metric=val/loss"],
}
# Metrics that count nearest neighbours (simclr's val/knn_acc, and val/acc: a view's nearest is its positive) of an
# 8-wide embedding 5 steps old: in bf16 about 4% of its samples sit at a near tie, which the round-off of another
# batch split may rightly flip (a flip of one of UNEVEN's 24 samples is 4.2e-2, beyond bf16's tolerance). Left out of
# such cases' metrics; their parameters, optimizer state and losses are compared as every case's are.
NEAR_TIES = {("simclr", "bf16"): ("*/knn_acc*", "*/acc*")}
HF = ("gpt2_lora", "opt")
STRATEGIES = {
    "single": ["parallel=single"],
    "ddp": ["parallel=ddp", "parallel.nproc_per_node=2"],
    "fsdp": ["parallel=fsdp", "parallel.nproc_per_node=2"],
    "fsdp_noreshard": ["parallel=fsdp", "parallel.nproc_per_node=2", "parallel.reshard_after_forward=false"],
    "hsdp": ["parallel=fsdp", "parallel.nproc_per_node=2", "parallel.replicate=2"],  # 2 copies of 1 shard
}
# A stopped case resumes under another strategy, from its checkpoint's format into another's.
RESUMED_UNDER = {"single": "fsdp", "ddp": "fsdp", "fsdp": "ddp", "fsdp_noreshard": "single", "hsdp": "ddp"}
CHECKPOINTS = {
    "full": ["parallel.checkpoint=full"],
    "sharded": ["parallel.checkpoint=sharded"],
    "async": ["parallel.async_checkpoint=true", "parallel.checkpoint=sharded"],
}
UNEVEN = [
    "data.batch_size=12",
    "data.val_batch_size=12",
    "data.drop_last=false",
    "trainer.limit_train_samples=29",
    "trainer.max_steps=5",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]
STOP_AFTER = 2
STOP = ["+callbacks.stop._target_=hydraloop.exactness.StopAfterStep", f"+callbacks.stop.step={STOP_AFTER}"]

# What hydraloop refuses in one line (exit 2): left out of the cases, and each asserted once below.
REFUSALS = [
    ({"strategy": strategy, "checkpoint": checkpoint}, f"parallel has no key '{key}' (it is a key of parallel=fsdp)")
    for strategy in ("single", "ddp")
    for checkpoint, key in (("sharded", "checkpoint"), ("async", "async_checkpoint"))
]


def applies(row: dict) -> bool:
    """Whether a (partial) case means anything: Hugging Face's gradient checkpointing needs a Hugging Face model,
    and the average's evaluation needs the average."""
    if row.get("recompute") == "hf_gradient_checkpointing" and row.get("model", HF[0]) not in HF:
        return False
    return not (row.get("evaluation") in ("ema_eval", "ema_predict") and row.get("callbacks") == "none")


def refused(row: dict) -> bool:
    return any(all(row.get(axis) == value for axis, value in combination.items()) for combination, _ in REFUSALS)


def allowed(row: dict) -> bool:
    return applies(row) and not refused(row)


CASES = covering_array(AXES, allowed)


def case_id(case: dict) -> str:
    """The case's model and strategy, and its other values but the first of each axis (none, 1, 32, full)."""
    shown = [str(case["model"]), str(case["strategy"])]
    for axis in list(AXES)[2:]:
        if case[axis] != AXES[axis][0]:
            shown.append(f"{axis}={case[axis]}" if axis in ("accumulation", "callbacks") else str(case[axis]))
    return "-".join(shown)


def training(case: dict, resumed_under: str | None = None) -> list[str]:
    """A case's training command; or the command that resumes it under another strategy, which reads the case's
    checkpoint and writes its own default kind."""
    strategy = resumed_under or case["strategy"]
    checkpoint = [] if resumed_under else CHECKPOINTS[case["checkpoint"]]
    if checkpoint == CHECKPOINTS["full"] and STRATEGIES[strategy][0] != "parallel=fsdp":
        checkpoint = []  # the only kind single and ddp write
    recompute = {
        "none": [],
        "activation_checkpointing": [
            "trainer.activation_checkpointing=" + ("[Linear]" if case["model"] in ("mlp", "gan", "simclr") else "true")
        ],
        "hf_gradient_checkpointing": ["model.gradient_checkpointing=true"],
    }[case["recompute"]]
    return [
        *MODELS[case["model"]],
        *UNEVEN,
        *STRATEGIES[strategy],
        *checkpoint,
        *recompute,
        f"trainer.grad_accum_steps={case['accumulation']}",
        f"trainer.precision={case['precision']}",
        *(["callbacks=[ema]"] if case["callbacks"] == "ema" else []),
        *(["trainer.eval_best=true"] if case["evaluation"] == "eval_best" else []),
    ]


class References:
    """One single-process run per model and precision, trained in this process when a case first needs it."""

    def __init__(self, train_here) -> None:
        self.train_here = train_here
        self.runs: dict[tuple[str, str], Path] = {}

    def run(self, model: str, precision: str) -> Path:
        if (model, precision) not in self.runs:
            case = dict(model=model, precision=precision, callbacks="ema", evaluation="eval_best")
            case |= dict(strategy="single", recompute="none", checkpoint="full", accumulation=1)
            self.runs[model, precision] = self.train_here(*training(case))
        return self.runs[model, precision]


def averaged_predictions(run_dir: Path, inputs_file: Path) -> dict[str, torch.Tensor]:
    """What mode=predict ckpt_weights=ema should give for a run's last checkpoint, computed here without it: the
    model built from the checkpoint's config, the average copied into its parameters (as the EMA callback validates
    it: tied weights are one parameter), the task's predictions of the file's inputs."""
    checkpoint = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    cfg = OmegaConf.create(checkpoint["config"])
    model = instantiate(cfg.model)
    model.load_state_dict(checkpoint["model"])
    parameters = dict(model.named_parameters())
    task = instantiate(cfg.task)
    inputs = load_inputs(str(inputs_file), list(cfg.data.input_shape), tokens=task.tokens_per_sample is not None)
    with torch.no_grad():
        for name, average in checkpoint["callbacks"]["ema"]["weights"].items():
            parameters[name].copy_(average)
        with Precision(str(cfg.trainer.precision), torch.device("cpu")).autocast():
            return {name: value.cpu() for name, value in task.predict(model.eval(), inputs).items()}


def evaluation(case: dict, run_dir: Path, mode: str, files: dict) -> list[str]:
    """`mode=eval` or `mode=predict` of a run's last checkpoint's average (ckpt_weights=ema), under the case's
    strategy."""
    return [
        *MODELS[case["model"]],
        *UNEVEN,
        *STRATEGIES[case["strategy"]],
        f"trainer.precision={case['precision']}",
        f"mode={mode}",
        f"ckpt_path={run_dir / 'checkpoints' / 'last.pt'}",
        "ckpt_weights=ema",
        *([f"data.predict_path={files[case['model']]}"] if mode == "predict" else []),
    ]


@pytest.fixture(scope="module")
def predict_files(tmp_path_factory) -> dict[str, Path]:
    """5 inputs per model (an odd number: the ranks predict 3 and 2), as mode=predict reads them."""
    folder = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    inputs = {
        "mlp": rng.standard_normal((5, 8)).astype(np.float32),
        "gan": rng.standard_normal((5, 2)).astype(np.float32),
        "simclr": rng.random((5, 1, 8, 8)).astype(np.float32),
        **{model: rng.integers(0, 20, (5, block)) for model, block in BLOCKS.items()},  # ids of the plays' characters
    }
    files = {}
    for model, x in inputs.items():
        files[model] = folder / f"{model}.npz"
        np.savez(files[model], x=x)
    return files


@pytest.fixture(scope="module")
def references(data_cache, tmp_path_factory) -> References:
    """Trained by src/train.py's task function in this process (the single-process command without its start-up)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(data_cache))
        patch.syspath_prepend(str(REPO / "src"))
        import train  # src/train.py; importing registers the schemas

        def train_here(*overrides: str) -> Path:
            run_dir = tmp_path_factory.mktemp("matrix-reference")  # pytest keeps the last 3 sessions' and no more
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
                cfg = compose("train", overrides=[*overrides, f"output_dir={run_dir}", f"log_file={run_dir}/train.log"])
            train.main.__wrapped__(cfg)
            return run_dir

        yield References(train_here)


def near_tie(case: dict, metric: str) -> bool:
    return any(
        fnmatch.fnmatchcase(metric, pattern) for pattern in NEAR_TIES.get((case["model"], case["precision"]), ())
    )


def lacking(case: dict) -> tuple[str, ...]:
    """What a reference (callbacks=[ema], trainer.eval_best=true) has that the case has not: the average (its state
    and val/ema/... metrics) without callbacks=[ema], best/... without trainer.eval_best."""
    without_average = ("callbacks/*", "metrics/val/ema/*", "metrics/best/val/ema/*")
    return (
        *(without_average if case["callbacks"] == "none" else ()),
        *(() if case["evaluation"] == "eval_best" else ("metrics/best/*",)),
    )


def test_the_cases_cover_every_pair_that_applies_and_each_refusal_is_a_case_of_its_own():
    assert uncovered_pairs(AXES, allowed, CASES) == []
    assert len(CASES) <= 31  # the suite's budget: 6 models x 5 strategies (30) cover their pairs, and one more
    assert not any(refused(case) or not applies(case) for case in CASES)
    for combination, _ in REFUSALS:  # each refused pair could otherwise stand in a case
        assert applies(combination) and refused(combination)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(case) for case in CASES])
def test_a_case_computes_what_single_computes(case, run_train, references, predict_files):
    """Trained (stopped and resumed under another strategy), then evaluated or predicted with its average, each
    against single: the reference's training, its own validation of the average, the average's predictions."""
    reference = references.run(case["model"], case["precision"])
    tolerance = TOLERANCES[case["precision"]]
    if case["resume"] == "stop_resume":
        stopped = run_train(*training(case), *STOP)
        assert stopped.returncode == 143, stopped.output  # 128 + SIGTERM, after its checkpoint
        assert f"stopping after step {STOP_AFTER}" in stopped.log
        run = run_train(*training(case, RESUMED_UNDER[case["strategy"]]), run_dir=stopped.run_dir)
    else:
        run = run_train(*training(case))
    assert run.returncode == 0, run.output
    reference_state, state = final_state(reference), final_state(run.run_dir)
    for final in (reference_state, state):
        for name in [n for n in final.parts["metrics"] if near_tie(case, n)]:
            del final.parts["metrics"][name]
    comparison = compare(reference_state, state, tolerance, may_lack=lacking(case))
    assert comparison.passed, table([(case_id(case), comparison)])
    if case["evaluation"] == "ema_eval":  # the average, evaluated under the case's strategy: val/ema/... of single
        evaluated = run_train(*evaluation(case, run.run_dir, "eval", predict_files))
        assert evaluated.returncode == 0, evaluated.output
        saved = json.loads((reference / "metrics.json").read_text())
        averaged = {name.replace("/ema/", "/"): value for name, value in saved.items() if name.startswith("val/ema/")}
        metrics = {name: value for name, value in evaluated.metrics.items() if name.startswith("val/")}
        averaged = {name: value for name, value in averaged.items() if not near_tie(case, name)}
        metrics = {name: value for name, value in metrics.items() if not near_tie(case, name)}
        difference = compare_entries(averaged, metrics, tolerance, floor=1.0)
        assert difference.first is None, (difference, metrics, averaged)
    if case["evaluation"] == "ema_predict":  # the average's predictions under the case's strategy
        predicted = run_train(*evaluation(case, run.run_dir, "predict", predict_files))
        assert predicted.returncode == 0, predicted.output
        # The case's own average, predicted here: its training was compared with single's above, to a tolerance;
        # an argmax of two such trainings (a next token at a near tie, in bf16) may rightly differ.
        expected = averaged_predictions(run.run_dir, predict_files[case["model"]])
        difference = compare_entries(expected, arrays(predicted.run_dir / "predictions.npz"), tolerance)
        assert difference.first is None, difference


def arrays(path: Path) -> dict[str, torch.Tensor]:
    """A predictions.npz as tensors by name."""
    with np.load(path) as held:
        return {name: torch.from_numpy(held[name]) for name in held.files}


@pytest.mark.parametrize("combination, line", REFUSALS, ids=[" x ".join(map(str, c.values())) for c, _ in REFUSALS])
def test_a_refused_combination_is_one_line(combination, line, run_refused):
    case = dict(CASES[0]) | combination  # the first case, but for the refused pair
    refused_run = run_refused(*training(case))
    assert line in bad_input_line(refused_run)
