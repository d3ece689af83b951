"""Stopping on request: SIGTERM or SIGUSR1 (what SLURM sends on preemption or before a time limit, and what torchrun
forwards to its workers when it is itself asked to stop), and SIGUSR2 (submitit's time-limit warning).

The handler only records the signal. The loop acts on it where the ranks next meet in an all-reduce (a logging,
validation or checkpoint step, or the epoch end): the request travels in that reduction, so every rank stops after
the same step even if the signal reached only some of them, or reached them at different steps.

A handler that was installed before (submitit's, which requeues the job on SIGUSR2) is called once the checkpoint is
written, instead of at once in the middle of a step: the requeued job then resumes from that checkpoint.
"""

import logging
import signal
import threading
from types import FrameType

from hydraloop.errors import Interrupted

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """`signum` is the first stop signal received (0: none). A context manager that installs the handlers."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
            log.warning(
                "got %s: stopping at the next logging, validation or checkpoint step (or epoch end), with a checkpoint",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, traceback: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        previous = self._previous.get(exc.signum) if isinstance(exc, Interrupted) else None
        if callable(previous):  # SIG_DFL and SIG_IGN are not
            previous(exc.signum, None)
