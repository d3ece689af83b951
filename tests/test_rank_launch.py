"""How hydraloop.parallel.spawned_ranks starts ranks and reads their end: stop signals that reach a rank early or
late, when a fork is safe, and what a forked rank runs at its exit."""

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _finish_then_get_a_stop_signal(stop_marks: str) -> None:
    from hydraloop.parallel.spawned_ranks import run_rank

    assert run_rank(stop_marks, os.getppid(), int, 7) == 7
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's signal, passed on after this rank's work was done


def test_a_stop_signal_reaching_a_rank_that_finished_its_work_does_not_fail_it(tmp_path):
    """The launcher passes a stop signal on asynchronously: a rank that has returned its result (while the others
    finish the run) must still exit 0, or the agent reports a finished run as a failed rank (exit 1)."""
    rank = multiprocessing.get_context("fork").Process(target=_finish_then_get_a_stop_signal, args=(str(tmp_path),))
    rank.start()
    rank.join(30)
    assert rank.exitcode == 0


def _stop_alone(marks: str, launcher_is_parent: bool) -> None:
    from hydraloop.parallel.rank_stops import mark_stopped_alone

    # The launcher gone, the rank's parent is another process (init, a subreaper), which it must not signal.
    mark_stopped_alone(marks, signal.SIGUSR1, os.getppid() if launcher_is_parent else os.getppid() + 1)


@pytest.mark.parametrize("launcher_is_parent", [True, False])
def test_a_rank_stopped_alone_hands_its_signal_to_its_launcher_and_to_no_other_parent(tmp_path, launcher_is_parent):
    """A rank that a signal the launcher did not pass on stopped before its training hands it to the launcher (its
    peers would wait for it until parallel.timeout_s); once the launcher is gone (whose end sends each rank SIGINT),
    it sent that to init or a subreaper, its parent then."""
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        rank = multiprocessing.get_context("fork").Process(target=_stop_alone, args=(str(tmp_path), launcher_is_parent))
        rank.start()
        rank.join(30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert rank.exitcode == 0 and (tmp_path / "rank-0").read_text() == "SIGUSR1"
    assert got == ([signal.SIGUSR1] if launcher_is_parent else [])


def test_a_stop_signal_that_kills_a_rank_still_starting_is_a_stop_not_a_failure():
    """A rank that cannot take the signal yet (still importing) is ended by its default handler: the launcher that
    passed it on reports the stop (Interrupted, exit 128 + 15), not a failed rank."""
    from hydraloop.errors import Interrupted
    from hydraloop.parallel.spawned_ranks import launch_ranks
    from rank_workers import deaf_rank_signalling_its_launcher

    with pytest.raises(Interrupted) as stop:
        launch_ranks(1, 0, 30, "spawn", deaf_rank_signalling_its_launcher)
    assert stop.value.signum == signal.SIGTERM and "while the ranks were starting, before training" in str(stop.value)


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_a_rank_alone_that_kills_it_still_starting_is_a_stop_not_a_failure(sent):
    """The same signal sent to that rank alone, which the launcher did not pass on: `rank 0 failed (exit code -15)`,
    exit 1, before."""
    from hydraloop.errors import Interrupted
    from hydraloop.parallel.spawned_ranks import launch_ranks
    from rank_workers import deaf_rank_signalled_alone

    with pytest.raises(Interrupted) as stop:
        launch_ranks(1, 0, 30, "spawn", deaf_rank_signalled_alone, sent)
    assert stop.value.signum == signal.Signals[sent] and "while the ranks were starting" in str(stop.value)


def run_launcher(env: dict[str, str], script: str, *args: str) -> list[str]:
    """`python -c script args` in tests/, as a launcher of ranks: its output lines (stdout, then stderr); exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines() + proc.stderr.splitlines()


LAUNCHER_WITH_A_POOL = """
import torch
from rank_workers import exp_on_two_threads
from hydraloop.parallel.ddp import DDPStrategy
from hydraloop.parallel.spawned_ranks import count_threads_before_computing, forkable

count_threads_before_computing()  # as src/train.py does once imported
print(forkable())
torch.set_num_threads(2)
torch.randn(10**7).exp_()  # starts OpenMP's pool of threads in this process
print(forkable())
print(DDPStrategy(device="cpu", nproc_per_node=2, start_method="fork").launch(exp_on_two_threads))
"""

FORK_SERVER = """
import multiprocessing.forkserver
from hydraloop.parallel.spawned_ranks import count_threads_before_computing, forkable

count_threads_before_computing()
multiprocessing.forkserver.ensure_running()  # as a data loader with workers starts it
print(forkable())
"""


def test_a_launcher_that_started_a_thread_pool_or_a_fork_server_spawns_its_ranks(train_env):
    """Ranks are forked on the CPU, but not from a process that has computed on several threads (a job before this
    one in a sweep's process): a forked rank's first op on several threads would wait forever on the pool's threads,
    which a fork does not copy. It spawns them, saying so where fork was asked for, and they compute. Nor from one
    that started a multiprocessing fork server, which a forked rank's data loader would ask for processes that are
    not its children."""

    before, after, *said = run_launcher(train_env, LAUNCHER_WITH_A_POOL)
    assert before == "None" and after.startswith("this process has started") and "computed" in said
    assert any("parallel.start_method=fork: the ranks are spawned instead, as this process" in line for line in said)
    assert run_launcher(train_env, FORK_SERVER) == ["this process has started a multiprocessing fork server"]


LAUNCHER_OF_FORKED_RANKS = """
import atexit, sys, tempfile
from pathlib import Path
from rank_workers import record_at_exit
from hydraloop.errors import WorkerFailed
from hydraloop.parallel.spawned_ranks import launch_ranks

record = Path(sys.argv[1])
folder = tempfile.TemporaryDirectory()  # removed at the launcher's exit: by a weakref finalizer, which ranks inherit
atexit.register(lambda: record.open("a").write("import "))  # as an imported module registers one
launch_ranks(2, 0, 30, "fork", record_at_exit, str(record), -1)
print(sorted(record.read_text().split()))
try:
    launch_ranks(2, 0, 30, "fork", record_at_exit, str(record), 1)
except WorkerFailed as failed:
    print(failed)
print(Path(folder.name).is_dir(), sorted(record.read_text().split()))
"""


def test_forked_ranks_run_the_exit_handlers_a_spawned_rank_would(train_env, tmp_path):
    """A forked process ends with os._exit, past atexit. A forked rank still runs, once its result or error is on
    record, its own handlers (CSVLogger's last row and MLflow's FAILED status when it raises, the process group's
    teardown) and those it inherited, which its launcher's imports registered, as a spawned rank's imports register
    them (torch's, a user module's); not the launcher's weakref finalizers (its temporary folder would be deleted)."""
    record = tmp_path / "exits"
    returned, failed, raised, *_ = run_launcher(train_env, LAUNCHER_OF_FORKED_RANKS, str(record))  # then stderr
    assert returned == "['import', 'import', 'rank0', 'rank1']"
    assert failed.startswith("rank 1 failed (exit code 1): RuntimeError: rank 1 raised")
    assert raised == "True ['import', 'import', 'import', 'import', 'rank0', 'rank0', 'rank1', 'rank1']"
    assert sorted(record.read_text().split()).count("import") == 5  # and the launcher's own, at its exit
