"""What the launcher of spawned ranks (hydraloop.parallel.ddp, without torchrun) adds around them for stop signals:
it passes a signal on to the ranks and waits for what they decide (hydraloop.preemption), and a rank that stopped
returns that as its result, not as a failure."""

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import FrameType
from typing import TypeVar

from torch.distributed.elastic.multiprocessing import SignalException

from hydraloop.errors import Interrupted
from hydraloop.preemption import STOP_SIGNALS, StopRequest, stop_at_once

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stopped:
    """What a spawned rank that a stop signal ended returns: a result, not a failure, which the agent would restart
    (parallel.max_restarts) where the signal asked the job to stop. `where`: Interrupted's message after the signal."""

    signum: int
    where: str


def run_rank(worker: Callable[..., T], *args) -> T | Stopped:
    """A spawned rank: `worker(*args)`. Before and after the training loop's own handling of stop signals
    (hydraloop.preemption.StopRequest), one ends the rank through Interrupted too (stop_at_once), not by the signal's
    default, which the agent would take for a failed rank."""
    with stop_at_once():
        try:
            return worker(*args)
        except Interrupted as stop:
            return Stopped(stop.signum, str(stop).removeprefix(f"stopped by {signal.Signals(stop.signum).name} "))


@contextmanager
def passed_on_to_ranks(shutdown_timeout_s: float) -> Iterator[StopRequest]:
    """The launcher of spawned ranks, while they run: a stop signal (hydraloop.preemption.STOP_SIGNALS) is passed on
    to its child processes, the ranks, and the agent goes on watching them. So the ranks decide together what it
    means, as they do under every strategy: a checkpoint where they next meet, then a stop; or, where the last step's
    meeting has passed, the run's end (its validation, checkpoint and metrics.json), and exit 0. (The agent's own
    handling shuts the ranks down at once and drops what they return: a rank that finished waited for its SIGKILL.)

    Ranks still running `shutdown_timeout_s` after the first signal are ended as the agent ends them on its own
    signals: its handler's SignalException, here SIGKILL's, makes it kill them, with no restart. A signal that finds
    no rank running (none started yet) is the agent's at once, as SignalException too. Yields a StopRequest holding
    the first signal passed on."""
    passed_on = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield passed_on
        return

    def pass_on(signum: int, frame: FrameType | None) -> None:
        ranks = multiprocessing.active_children()  # the agent starts the ranks as this process's children
        if not ranks:
            raise SignalException(f"got {signal.Signals(signum).name} with no rank running", signal.Signals(signum))
        for rank in ranks:
            with suppress(ProcessLookupError):  # ended meanwhile
                os.kill(rank.pid, signum)
        if not passed_on.signum:
            passed_on.signum = signum
            log.info("got %s: passed on to the ranks", signal.Signals(signum).name)
            signal.setitimer(signal.ITIMER_REAL, shutdown_timeout_s)

    def out_of_time(signum: int, frame: FrameType | None) -> None:
        raise SignalException("the ranks did not stop in time", signal.SIGKILL)

    previous = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, out_of_time)
    try:
        yield passed_on
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
