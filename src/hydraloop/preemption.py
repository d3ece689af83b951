"""Stopping on request: SIGTERM or SIGUSR1 (what SLURM sends on preemption or before a time limit, and what torchrun
forwards to its workers when it is itself asked to stop), and SIGUSR2 (submitit's time-limit warning).

The handler only records the signal. The loop acts on it where the ranks next meet in an all-reduce (a logging,
validation or checkpoint step, or the epoch end): the request travels in that reduction, so every rank stops after
the same step even if the signal reached only some of them, or reached them at different steps.

The same rule under every strategy and launcher: a signal the ranks agree on before the run's last step ends the run
there, with a checkpoint, no metrics.json and exit 128 + its number; one agreed on at the last step, or arriving after
it (in the final validation, checkpoint, metrics.json), lets the run finish as it would have, exit 0, with nothing
left to stop for. So metrics.json always means finished, and a rerun into the directory either finds it finished or
continues from the checkpoint (hydraloop.resume). A launcher of spawned ranks passes the signal on to them and
reports what they did (hydraloop.parallel.ddp).

A handler that was installed before (submitit's, which requeues the job on SIGUSR2) is called once the checkpoint is
written, instead of at once in the middle of a step: the requeued job then resumes from that checkpoint.

Outside the training loop, from the moment a run owns its directory (hydraloop.run_lock), `stop_at_once` makes a
stop signal end the process through Python's exception path rather than the signal's default, which would end it on
the spot: the run directory's lock is released, and a run stopped before it has written a record leaves the
directory as it was (hydraloop.run_records). Exit code 128 + the signal's number, as for a stop in the loop.
"""

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from hydraloop.errors import Interrupted

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

_loops_entered = 0  # StopRequests entered by this process (and those it was forked from): see `loops_entered`


def loops_entered() -> int:
    """How many training loops' stop handling (StopRequest) this process has entered, its parent's before a fork
    included: a rank compares it with its count at start to tell a stop before its training from one in or after
    it (hydraloop.parallel.rank_stops)."""
    return _loops_entered


class StopRequest:
    """`signum` is the first stop signal received (0: none). A context manager that installs the handlers."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
            log.warning(
                "got %s: stopping at the next logging, validation or checkpoint step (or epoch end), with a "
                "checkpoint; past the run's last step, it finishes instead",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> "StopRequest":
        global _loops_entered
        _loops_entered += 1
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, traceback: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        previous = self._previous.get(exc.signum) if isinstance(exc, Interrupted) else None
        if callable(previous) and previous is not _stop_now:  # SIG_DFL and SIG_IGN are not callable
            previous(exc.signum, None)


def _stop_now(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum, "outside the training loop, without a checkpoint")


@contextmanager
def stop_at_once() -> Iterator[None]:
    """While it lasts, a stop signal whose handler is the default raises Interrupted (see the module docstring);
    StopRequest takes over inside it while the loop runs. Handlers installed by others (submitit's) stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in ours:
        signal.signal(sig, _stop_now)
    try:
        yield
    finally:
        for sig in ours:
            if signal.getsignal(sig) is _stop_now:  # torch.distributed.elastic's launcher installs its own
                signal.signal(sig, signal.SIG_DFL)
