"""Stopping on request: SIGTERM or SIGUSR1 (what SLURM sends before a time limit or on preemption, and what torchrun
forwards to its workers when it is itself asked to stop).

The handler only records the signal. The loop acts on it at its next logging step or epoch end, where the ranks
already meet in an all-reduce: the request travels in that reduction, so every rank stops after the same step even
if the signal reached only some of them, or reached them at different steps.
"""

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """`signum` is the first stop signal received (0: none). A context manager that installs the handlers."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
            log.warning("got %s: stopping after the next logging step, with a checkpoint", signal.Signals(signum).name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
