"""hparams_search=mnist1d_optuna: an Optuna (TPE) study over real training jobs. What the sweeper reports as best
must be the best of what the jobs wrote, and the best parameters must be what that job trained with."""

import json
import math

import pytest
import yaml
from hydra import compose, initialize_config_dir

from conftest import REPO
from hydraloop.config import register_configs

SEARCHED = ("optimizer.lr", "optimizer.weight_decay", "model.dropout", "model.hidden_sizes")


def compose_search(*overrides: str):
    register_configs()  # the sweep_direction resolver
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=["hparams_search=mnist1d_optuna", *overrides], return_hydra_config=True)


def test_search_config():
    cfg = compose_search()
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == 0
    assert sweeper.direction == "maximize" and sweeper.n_trials == 30
    assert tuple(sweeper.params) == SEARCHED
    assert sweeper.params["optimizer.lr"] == "tag(log, interval(1e-4, 3e-2))"
    assert cfg.data.dataset._target_ == "hydraloop.data.mnist1d.load_mnist1d"
    assert cfg.model._target_ == "hydraloop.models.mlp.MLP"
    assert cfg.scheduler._target_ == "hydraloop.schedulers.cosine_with_warmup"
    # The direction follows the metric's mode.
    assert (
        compose_search("optimized_metric=val/loss", "optimized_metric_mode=min").hydra.sweeper.direction == "minimize"
    )


def jobs(sweep_dir):
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def overrides_of(job) -> dict[str, str]:
    lines = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    return dict(line.split("=", 1) for line in lines)


def check_study(sweep_dir, metric: str, best_of, trials: int) -> None:
    """optimization_results.yaml against the jobs' own metrics.json, overrides and resolved configs."""
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    found = {job.name: json.loads((job / "metrics.json").read_text())[metric] for job in jobs(sweep_dir)}
    assert len(found) == trials
    assert results["best_value"] == best_of(found.values())

    best = results["best_params"]
    assert set(best) == set(SEARCHED)
    # Exactly one job was launched with the best parameters, and it scored the best value.
    matching = [job for job in jobs(sweep_dir) if all(overrides_of(job)[key] == str(best[key]) for key in SEARCHED)]
    assert len(matching) == 1, (best, [overrides_of(job) for job in jobs(sweep_dir)])
    job = matching[0]
    assert found[job.name] == results["best_value"]
    # ...and it trained with them: the resolved config holds those values.
    config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
    assert config["optimizer"]["lr"] == best["optimizer.lr"]
    assert config["optimizer"]["weight_decay"] == best["optimizer.weight_decay"]
    assert config["model"]["dropout"] == best["model.dropout"]
    assert config["model"]["hidden_sizes"] == yaml.safe_load(best["model.hidden_sizes"])
    # Every trial sampled inside the search space.
    for job in jobs(sweep_dir):
        params = overrides_of(job)
        assert 1e-4 <= float(params["optimizer.lr"]) <= 3e-2
        assert 0 <= float(params["optimizer.weight_decay"]) <= 0.2 and 0 <= float(params["model.dropout"]) <= 0.5


TINY = (
    "trainer.max_epochs=1",
    "logger=none",
    "trainer.save_checkpoints=false",
    "model.hidden_sizes=choice('[16]','[32]')",
)  # a search-space key on the command line replaces the file's


@pytest.mark.slow
def test_three_trials_minimizing_val_loss(run_train, tmp_path):
    run = run_train(
        "-m",
        "hparams_search=mnist1d_optuna",
        "hydra.sweeper.n_trials=3",
        *TINY,
        "optimized_metric=val/loss",  # its mode follows: min
        f"hydra.sweep.dir={tmp_path}",
    )
    assert run.returncode == 0, run.output
    assert "Directions: ['minimize']" in run.output
    check_study(tmp_path, "val/loss", min, trials=3)
    for job in jobs(tmp_path):
        assert overrides_of(job)["model.hidden_sizes"] in ("[16]", "[32]")
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 1 and math.isfinite(metrics["val/loss"])


@pytest.mark.slow
def test_two_trials_under_ddp(run_train, tmp_path):
    run = run_train(
        "-m",
        "hparams_search=mnist1d_optuna",
        "hydra.sweeper.n_trials=2",
        *TINY,
        "parallel=ddp",
        f"hydra.sweep.dir={tmp_path}",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    assert "Directions: ['maximize']" in run.output
    check_study(tmp_path, "val/acc", max, trials=2)
    assert all(json.loads((job / "metrics.json").read_text())["world_size"] == 2 for job in jobs(tmp_path))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Deprecated API features detected")  # SQLAlchemy 1.4 on optuna 2's use of it
def test_a_stored_study_resumes(run_train, tmp_path):
    """hydra.sweeper.storage=sqlite:///...: a second search on the same study continues it. Its trials are numbered on
    from the first search's, and its best is the best of all trials, the first search's included."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    common = ("hparams_search=mnist1d_optuna", "data=digits", *TINY, "trainer.limit_train_batches=4")
    sweeps = [tmp_path / "first", tmp_path / "second"]
    for sweep_dir in sweeps:  # the second, a rerun after the first stopped, gets its own folder as usual
        run = run_train(
            "-m",
            *common,
            "hydra.sweeper.n_trials=2",
            f"hydra.sweeper.storage={storage}",
            f"hydra.sweep.dir={sweep_dir}",
        )
        assert run.returncode == 0, run.output
    import optuna

    study = optuna.load_study(study_name="mnist1d_mlp", storage=storage)
    trials = sorted(study.trials, key=lambda trial: trial.number)
    assert [trial.number for trial in trials] == [0, 1, 2, 3]
    assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in trials)
    found = [json.loads((job / "metrics.json").read_text())["val/acc"] for sweep in sweeps for job in jobs(sweep)]
    assert [trial.value for trial in trials] == found  # trial 2 is the second search's first job
    for trial, job in zip(trials[2:], jobs(sweeps[1])):
        assert overrides_of(job)["optimizer.lr"] == str(trial.params["optimizer.lr"])
    results = yaml.safe_load((sweeps[1] / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(found)


@pytest.mark.slow
def test_a_language_model_search_minimises_perplexity(run_train, tmp_path):
    tiny_gpt = (
        "model.n_layer=1",
        "model.n_embd=32",
        "data.block_size=32",
        "trainer.max_steps=6",
        "scheduler.warmup_steps=2",
    )
    run = run_train(
        "-m",
        "hparams_search=text_gpt_optuna",
        "hydra.sweeper.n_trials=2",
        *tiny_gpt,
        "trainer.limit_val_batches=2",
        "logger=none",
        "trainer.save_checkpoints=false",
        "optimized_metric=val/ppl",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert run.returncode == 0, run.output
    assert "Directions: ['minimize']" in run.output
    found = [json.loads((job / "metrics.json").read_text())["val/ppl"] for job in jobs(tmp_path)]
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert len(found) == 2 and results["best_value"] == min(found)
    assert set(results["best_params"]) == {"optimizer.lr", "model.dropout", "optimizer.weight_decay"}
