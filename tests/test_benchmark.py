"""The benchmark script runs and reports consistent figures (speed itself is never asserted in tests)."""

import json
import statistics
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_benchmark_reports_loop_and_startup_figures(tmp_path, train_env):
    out = tmp_path / "benchmark.json"
    proc = subprocess.run(
        [
            *[sys.executable, str(REPO / "scripts" / "benchmark.py"), "--smoke"],
            *["--repeats", "2", "--loop-processes", "2"],
            *[
                "--skip",
                "ddp",
                "memory",  # test_memory_benchmark_reports_each_ranks_peak_through_a_save_and_a_resume
                "hf_trainer",  # whole 3-epoch commands of two HF models, run by hand (docs/benchmarks.md)
                "--out",
                str(out),
                "--workloads",
                "synthetic MLP",
                "GPT, dict batches",  # the hand-written loop's other batch path; image folders are (d)'s
            ],
            *["--lightning-workloads", "synthetic MLP"],
        ],
        env=train_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [row["workload"] for row in report["loop"]] == ["synthetic MLP", "GPT, dict batches"]
    for row in report["loop"]:
        # Each process's ratio is the median of its back-to-back pairs'; the row's, the median over processes.
        assert len(row["processes"]) == 2
        for process in row["processes"]:
            samples = process["samples"]
            pairs = [ours / theirs for ours, theirs in zip(samples["hydraloop"], samples["hand-written"])]
            assert len(pairs) == 2 and process["ratio"] == pytest.approx(statistics.median(pairs))
        assert row["ratio"] == pytest.approx(statistics.median(process["ratio"] for process in row["processes"]))
        assert row["hydraloop_samples_per_s"] > 0 and row["handwritten_samples_per_s"] > 0
    startup = report["startup"]
    assert startup["overhead_vs_import_torch_s"] == pytest.approx(
        startup["train_py_first_step_s"] - startup["import_torch_s"]
    )
    assert [(row["todtype_normalize"], row["workers"]) for row in report["images"]] == [
        (where, workers) for where in ("per batch", "per sample") for workers in (0, 1, 2)
    ]
    for row in report["images"]:
        assert len(row["samples"]) == 2 and row["images_per_s"] == pytest.approx(statistics.median(row["samples"]))
    assert "(a) loop throughput" in proc.stdout and "(b) start-up" in proc.stdout and "(d) image folder" in proc.stdout
    (lightning,) = report["lightning"]["loop"]  # the bench extra is in dev: CI runs this row
    samples = lightning["samples"]
    assert lightning["ratio_vs_quiet"] == pytest.approx(
        statistics.median(ours / theirs for ours, theirs in zip(samples["hydraloop"], samples["Lightning, quiet"]))
    )
    runs = report["lightning"]["command_line"]
    assert runs["ratio"] == pytest.approx(runs["lightning_s"] / runs["hydraloop_s"]) and "(e) against" in proc.stdout


def test_memory_benchmark_reports_each_ranks_peak_through_a_save_and_a_resume(tmp_path, train_env):
    out = tmp_path / "memory.json"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_memory.py"), "--out", str(out)]
    options = ["--strategies", "fsdp", "--sizes", "1x64", "--repeats", "0", "--activations", "recompute"]
    proc = subprocess.run([*command, *options], env=train_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [(row["strategy"], row["activation_checkpointing"]) for row in report["rows"]] == [("fsdp", True)]
    for row in report["rows"]:
        for figures in (row["baseline_mib"], row["train_and_save_mib"], row["resume_and_save_mib"]):
            assert sorted(figures) == ["0", "1"] and all(mib > 100 for mib in figures.values())  # torch alone is more
        assert row["above_baseline_mib"] == {
            rank: round(
                max(row["train_and_save_mib"][rank], row["resume_and_save_mib"][rank]) - row["baseline_mib"][rank], 1
            )
            for rank in ("0", "1")
        }


def test_nanogpt_benchmark_scores_a_run_as_its_own_val_loss(tmp_path, train_env):
    """(g)'s scorer, which also scores nanoGPT's checkpoints, gives hydraloop's run its logged whole-validation loss:
    both sides are measured the same way. (nanoGPT itself is not shipped; its side runs where a checkout is given.)"""
    out = tmp_path / "nanogpt.json"
    script = REPO / "scripts" / "benchmark_nanogpt.py"
    text = REPO / "src" / "hydraloop" / "data" / "corpora" / "shakespeare.txt"
    command = [sys.executable, str(script), "--text", str(text), "--seeds", "3", "--steps", "30", "--out", str(out)]
    command += ["--loop-steps", "2", "--loop-rounds", "1"]
    proc = subprocess.run(command, env=train_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert set(report["loop_ms_per_step"]) == {"hydraloop", "hand-written"}, report
    assert "training loop, 1 x 2 steps: hydraloop" in proc.stdout
    (run,) = report["hydraloop"]
    assert run["seed"] == 3 and run["val_loss"] == pytest.approx(run["logged_val_loss"], rel=1e-5)
    assert 1.0 < run["val_loss"] < 4.2  # 30 steps: below a uniform guess over the plays' characters
    assert "whole-validation loss after 30 steps" in proc.stdout

    no_checkout = [*command[:2], "--text", str(text), "--nanogpt", str(tmp_path)]
    proc = subprocess.run(no_checkout, env=train_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"--nanogpt {tmp_path}: not a nanoGPT checkout (no train.py and model.py there)"
    ]


def test_attention_benchmark_shows_keyed_dropout_saves_no_attention_weights_at_a_long_sequence(tmp_path, train_env):
    """scripts/benchmark_attention.py (gpu_check's step 6) on the CPU, past 2 x BLOCK tokens: the keyed model saves
    none of the (batch, heads, T, T) weights; transformers' as shipped does (no fused kernel with dropout on a CPU)."""
    pytest.importorskip("transformers", reason="the hf extra (in dev)")
    out = tmp_path / "attention.json"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_attention.py"), "--device", "cpu", "--out", str(out)]
    sizes = ["--length", "264", "--batch", "2", "--layers", "1", "--width", "32", "--heads", "4", "--repeats", "1"]
    proc = subprocess.run([*command, *sizes], env=train_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keyed, torchs = json.loads(out.read_text())["rows"]
    assert keyed["attention_weights_elements"] == 2 * 4 * 264**2
    assert not keyed["saves_attention_weights"] and torchs["saves_attention_weights"], (keyed, torchs)
    assert keyed["ms_per_step"] > 0 and "keyed over torch's" in proc.stdout
