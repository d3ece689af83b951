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

Once a stop is under way (an Interrupted leaving the loop or `stop_at_once`), a further stop signal changes nothing:
it is logged and dropped (`ignore_further_stops`), where it would cut the stop's own exit path short (releasing the
lock, closing the loggers) or end the process by the signal's default action.
"""

import atexit
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)


class Interrupted(RuntimeError):
    """A stop signal ended the run after a checkpoint. Exits with 128 + the signal's number, as the shell reports a
    process the signal ended (143 for SIGTERM), so schedulers and sweepers do not count the run as finished."""

    def __init__(self, signum: int | str, message: str | None = None) -> None:
        """`Interrupted(signum, message)`; or `Interrupted(text)`, text being an Interrupted's own (its first line
        read): OmegaConf rebuilds an exception raised inside it as `type(error)(its text and the key's)`, and
        pickle as `type(error)(*error.args)`. A stop signal's Interrupted raised while OmegaConf reads a key (a
        rank reading its config) stays a stop."""
        if message is None:
            text = str(signum).strip()
            first = text.splitlines()[0] if text else ""
            name, _, message = first.removeprefix("stopped by ").partition(" ")
            if not first.startswith("stopped by ") or name not in signal.Signals.__members__:
                raise TypeError(f"Interrupted({signum!r}): needs a signal and a message, or an Interrupted's text")
            signum = signal.Signals[name]
        super().__init__(f"stopped by {signal.Signals(signum).name} {message}")
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


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
        self._sigint: object = None  # SIGINT's handler before a stop signal came: Ctrl-C ends the run at once

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
            # The first signal decides: a Ctrl-C after it (a terminal's reaches every rank) would end the run
            # without the checkpoint this one asked for.
            self._sigint = signal.signal(signal.SIGINT, _stop_under_way)
            log.warning(
                "got %s: stopping at the next logging, validation or checkpoint step (or epoch end), with a "
                "checkpoint; past the run's last step, it finishes instead",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> "StopRequest":
        global _loops_entered
        raise_a_lost_stop()
        _loops_entered += 1
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, traceback: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if isinstance(exc, Interrupted):  # on its way out through stop_at_once's handling
            ours = tuple(sig for sig, previous in self._previous.items() if previous is _stop_now)
            ignore_further_stops((*ours, signal.SIGINT))
        elif self._sigint is not None:  # the run finished (the signal came at its end)
            signal.signal(signal.SIGINT, self._sigint)
        previous = self._previous.get(exc.signum) if isinstance(exc, Interrupted) else None
        if callable(previous) and previous is not _stop_now:  # SIG_DFL and SIG_IGN are not callable
            previous(exc.signum, None)


_raised: BaseException | None = None
"""The stop this process's handlers raised and nothing has taken yet (`stop_taken`)."""


def _stop_now(signum: int, frame: FrameType | None) -> None:
    if not _on_its_way_out(signum):
        raise _raise(Interrupted(signum, "outside the training loop, without a checkpoint"))


def interrupt_once(signum: int, frame: FrameType | None) -> None:
    """SIGINT's handler in a run's processes: KeyboardInterrupt, as Python's own, but not on the way out of one: a
    second Ctrl-C would cut the first's way out short (the run directory's lock, a checkpoint write's clean-up) or,
    as the process exits, end it by the signal; Ctrl-C in a terminal reaches the ranks and their launcher, which
    passes it on too.

    Signals that came while the process was in C++ (a collective, a step's kernels) are taken in their numbers'
    order when it is back: SIGINT's before a SIGTERM's that came first. Ctrl-C then wins; after a stop signal taken,
    it is dropped (`StopRequest`)."""
    if not _on_its_way_out(signum):
        raise _raise(KeyboardInterrupt())


def _raise(stop: BaseException) -> BaseException:
    global _raised
    _raised = stop
    return stop


def _on_its_way_out(signum: int) -> bool:
    """Whether a stop this process raised is being handled where the signal `signum` lands (a `finally`, an
    `__exit__` on its way out): then the signal is dropped."""
    if _raised is None or not isinstance(sys.exc_info()[1], (Interrupted, KeyboardInterrupt)):
        return False
    _stop_under_way(signum, None)
    return True


def stop_in(error: BaseException) -> Interrupted | None:
    """`error` if it is a stop; else the stop this process's handler raised, where the code it landed in raised an
    error of its own from it (DTensor's sharding propagation re-raises any Exception as a RuntimeError: a stop signal
    while fsdp built its parameters was a failed rank, exit 1); else None."""
    if isinstance(error, Interrupted):
        return error
    seen = set()
    while error is not None and id(error) not in seen:
        if error is _raised:
            return _raised
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def raise_a_lost_stop() -> None:
    """A stop raised by a handler above that the code it landed in swallowed (a logging call's handler catches
    every Exception, a library's bare `except`: the run went on to its end), raised again: where the loop starts
    (`StopRequest`) and where the ranks are launched."""
    if _raised is not None:
        raise _raised


def stop_taken() -> None:
    """A stop has reached the code that ends the run with it (hydraloop.errors.exit_on_error, a rank handing it to
    its launcher): further signals are dropped, to the process's exit."""
    global _raised
    _raised = None
    ignore_further_stops((signal.SIGINT, *STOP_SIGNALS))


def _stop_under_way(signum: int, frame: FrameType | None) -> None:
    log.info("got %s: a stop is already under way", signal.Signals(signum).name)


def ignore_further_stops(signals: tuple[int, ...]) -> None:
    """From now on in this process (main thread), `signals` are logged and dropped: a stop is under way. A handler,
    not SIG_IGN, which a spawned process would inherit; `stop_at_once` takes it over again in a later job of the same
    process (a sweep's). At the process's exit it becomes SIG_IGN: Python's finalization sets a signal whose handler
    is a function back to its default action, which would end the process by the signal after all."""
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            signal.signal(sig, _stop_under_way)
        atexit.unregister(_ignored_at_exit)  # once
        atexit.register(_ignored_at_exit)


def _ignored_at_exit() -> None:
    for sig in signal.valid_signals():
        if signal.getsignal(sig) is _stop_under_way:
            signal.signal(sig, signal.SIG_IGN)


@contextmanager
def stop_at_once() -> Iterator[None]:
    """While it lasts, a stop signal whose handler is the default raises Interrupted (see the module docstring);
    StopRequest takes over inside it while the loop runs. Handlers installed by others (submitit's) stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) in (signal.SIG_DFL, _stop_under_way)]
    for sig in ours:
        signal.signal(sig, _stop_now)
    stopping = False
    try:
        yield
    except Exception as error:
        stop = stop_in(error)
        if stop is None:
            raise
        stopping = True
        if stop is error:
            raise
        raise stop from error
    finally:
        # Another's handler (torch.distributed.elastic's launcher installs its own) stays.
        ours = [sig for sig in ours if signal.getsignal(sig) in (_stop_now, _stop_under_way)]
        if stopping:
            ignore_further_stops(tuple(ours))
        else:
            for sig in ours:
                signal.signal(sig, signal.SIG_DFL)
