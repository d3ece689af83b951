"""Stop signals to the launcher of spawned ranks (hydraloop.parallel.spawned_ranks), and how the ranks' ends are read.

The launcher passes the first stop signal on to its ranks, which decide together what it means, as under every
strategy (hydraloop.preemption): a checkpoint where they next meet, then a stop; or, past the last step's meeting,
the run's end and exit 0. A rank that a stop ends returns that as its result (`Stopped`), not as a failure, which the
agent would restart (parallel.max_restarts) where the signal asked the job to stop. SIGINT (Ctrl-C) is passed on the
same way, and ends each rank at once, without a checkpoint. A further signal, once one is passed on, changes nothing.

Ranks meet only in training. A rank that the signal ends before its training started (in its set-up: joining the
process group, building, wrapping, resuming), or at once (SIGINT), or before it could take the signal at all (still
starting) leaves its peers waiting for it, in C++ where no signal reaches them (a store or gloo connect, DDP's check
of the parameters, a step's all-reduce) until their timeout (parallel.timeout_s), and the launcher until
parallel.shutdown_timeout_s. No checkpoint can come of such an end: the launcher gives the others `GRACE_S` to hand
in their own stop, then kills them, and reports the stop without pointing at a checkpoint. A rank that stops so on a
signal of its own, which the launcher did not pass on, hands it to the launcher: the same follows.
"""

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException

from hydraloop.errors import Interrupted
from hydraloop.preemption import STOP_SIGNALS, ignore_further_stops, interrupt_once

log = logging.getLogger(__name__)

PASSED_ON = (*STOP_SIGNALS, signal.SIGINT)
GRACE_S = 1.0
"""After a rank stopped alone (before its training, or at once): the other ranks' time to hand in their own stop
before they are killed (they got the signal too; one in Python code stops in milliseconds)."""
WRITER_GRACE_S = 3.0
"""The same, while rank 0, which writes the run's records, is taking a Ctrl-C: it may be finishing its loggers' runs
(W&B's takes about 1 s)."""
WATCH_INTERVAL_S = 0.1
PASSED_ON_MARK = "passed-on"
"""Beside the marks folder, once the launcher passed a signal on."""


@dataclass(frozen=True)
class Stopped:
    """What a rank that a stop signal ended returns: a result, not a failure. `where`: Interrupted's message after
    the signal's name."""

    signum: int
    where: str


def mark_stopped_alone(marks: str | Path, signum: int, launcher: int) -> None:
    """Tells the launcher (`passed_on_to_ranks`, process `launcher`) that this rank stopped on `signum` without its
    peers, before its training started or at once (SIGINT): they may wait for it where no signal reaches them. A
    signal the launcher did not pass on (`kill <this rank's pid>`, a scheduler's per task) is the launcher's too: the
    job stops, as on it, where the peers would have waited until parallel.timeout_s. Not once the launcher is gone (its
    end sends each rank SIGINT, torch's PR_SET_PDEATHSIG): the rank's parent is then init, or a subreaper."""
    (Path(marks) / f"rank-{os.environ.get('RANK', '0')}").write_text(signal.Signals(signum).name)
    if os.getppid() == launcher and not Path(marks).with_name(PASSED_ON_MARK).exists():
        os.kill(launcher, signum)


def mark_taking_ctrl_c(marks: str | Path) -> None:
    """Tells the launcher that this rank is taking a Ctrl-C (it is not waiting in C++): it will hand its stop in."""
    (Path(marks) / f"taking-{os.environ.get('RANK', '0')}").touch()


def interrupt_rank(marks: str | Path, signum: int, frame: FrameType | None) -> None:
    """A rank's SIGINT handler: Ctrl-C's KeyboardInterrupt (hydraloop.preemption.interrupt_once), marked as taken."""
    try:
        interrupt_once(signum, frame)
    except KeyboardInterrupt:  # not dropped: the launcher waits for this rank's way out of it
        mark_taking_ctrl_c(marks)
        raise


def took_ctrl_c(marks: Path) -> bool:
    """Whether a rank took a SIGINT, and ended at once: a terminal's Ctrl-C reaches the ranks, not only their
    launcher."""
    return any(path.name.startswith("taking-") or path.read_text() == "SIGINT" for path in marks.iterdir())


@dataclass
class PassedOn:
    """The launcher's record of the stop signals it passed on. `signum`: the first (0: none yet)."""

    signum: int = 0
    ranks: list[multiprocessing.Process] = field(default_factory=list)
    cut_short: str = ""
    """Why the ranks were killed before parallel.shutdown_timeout_s: a rank stopped alone, or ended with an error."""
    _deadline: float = 0.0
    _first_mark_at: float = 0.0


@contextmanager
def passed_on_to_ranks(shutdown_timeout_s: float, marks: Path, nproc: int) -> Iterator[PassedOn]:
    """The launcher of spawned ranks, while they run: the first stop signal (hydraloop.preemption.STOP_SIGNALS, or
    SIGINT) is passed on to its child processes, the `nproc` ranks (and to one that starts after it), and the agent goes
    on watching them; a later one is dropped. (The agent's own handling shuts the ranks down at once and drops what they
    return: a rank that finished waited for its SIGKILL; and it waits parallel.shutdown_timeout_s for one stuck in C++.)

    From the first signal on, the ranks are watched: they are ended, as the agent ends them on its own signals (its
    handler's SignalException, here SIGKILL's, makes it kill them, with no restart), `shutdown_timeout_s` after it, or
    once a rank stopped alone (a file in `marks`, `mark_stopped_alone`) while another has not (`GRACE_S` later,
    `WRITER_GRACE_S` while rank 0 is taking a Ctrl-C, `mark_taking_ctrl_c`), or ended with an error (at once: the agent
    would stop the others and wait 30 s for one stuck in C++, or restart them). A signal that finds no rank running
    (none started yet) is the agent's at once, as SignalException too. Once one was passed on, further signals are
    dropped on the way out of this block, however the ranks ended (hydraloop.preemption.ignore_further_stops)."""
    passed_on = PassedOn()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield passed_on
        return

    launcher = os.getpid()

    def pass_on(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != launcher:  # a forked rank, before it set its own handlers: ended as a spawned one would be
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if passed_on.signum:  # in a rank, it would cut its stop's exit path short
            log.info("got %s: the ranks are stopping already", signal.Signals(signum).name)
            return
        ranks = multiprocessing.active_children()  # the agent starts the ranks as this process's children
        if not ranks:
            raise SignalException(f"got {signal.Signals(signum).name} with no rank running", signal.Signals(signum))
        marks.with_name(PASSED_ON_MARK).touch()  # before the ranks take it: none hands it back
        for rank in ranks:
            with suppress(ProcessLookupError):  # ended meanwhile
                os.kill(rank.pid, signum)
        passed_on.ranks, passed_on.signum = ranks, signum
        passed_on._deadline = time.monotonic() + shutdown_timeout_s
        log.info("got %s: passed on to the ranks", signal.Signals(signum).name)
        signal.setitimer(signal.ITIMER_REAL, WATCH_INTERVAL_S, WATCH_INTERVAL_S)

    def watch(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if now >= passed_on._deadline:
            kill("the ranks did not stop in time")
        for rank in multiprocessing.active_children():  # one forked after the signal came: it gets it too
            if rank not in passed_on.ranks:
                with suppress(ProcessLookupError):
                    os.kill(rank.pid, passed_on.signum)
                passed_on.ranks.append(rank)
        ended = [rank.exitcode for rank in passed_on.ranks if rank.exitcode not in (None, 0)]
        if ended:
            passed_on.cut_short = f"a rank ended at once (exit code {ended[0]})"
            kill(passed_on.cut_short)
        names = {path.name for path in marks.iterdir()}
        stopped = sorted(name for name in names if name.startswith("rank-"))
        # Every rank stopped alone: none waits for another, and the agent collects what they handed in.
        if not names or len(stopped) == nproc:
            return
        passed_on._first_mark_at = passed_on._first_mark_at or now
        # Rank 0 writes the run's records: while it is taking a Ctrl-C (its loggers' last records), it gets longer.
        # A rank that took one and never hands it in (a KeyboardInterrupt that left a lock held) is ended with them.
        grace = WRITER_GRACE_S if "taking-0" in names and "rank-0" not in names else GRACE_S
        if now >= passed_on._first_mark_at + grace:
            what = "stopped before its training" if stopped else "took a Ctrl-C"
            passed_on.cut_short = f"{min(stopped or names).replace('-', ' ').replace('taking ', 'rank ')} {what}"
            kill(passed_on.cut_short)

    def kill(why: str) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)  # once: a second raise would cut the agent's kill short
        raise SignalException(why, signal.SIGKILL)

    previous = {sig: signal.signal(sig, pass_on) for sig in PASSED_ON}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, watch)
    stopping = False
    try:
        yield passed_on
    except Interrupted:
        stopping = True
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if stopping or passed_on.signum:  # also where a rank failed meanwhile: a stop was under way
            ignore_further_stops(PASSED_ON)
