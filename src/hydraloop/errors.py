"""The ways a run ends in error with one line instead of a Python traceback: bad input, a diverged loss, a failed
rank (whose own traceback is in the job log), a storage fault, and a stop signal."""

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hydra.errors import InstantiationException

# Interrupted is at home with the signals that raise it; imported from here, as the other errors are.
from hydraloop.preemption import Interrupted, stop_taken

log = logging.getLogger("hydraloop")

BAD_INPUT_EXIT_CODE = 2
FAILED_EXIT_CODE = 1
STORAGE_EXIT_CODE = 74  # EX_IOERR in sysexits.h: a wrapper script can tell a full disk from a failed run
CTRL_C = "(Ctrl-C: ended at once, without a checkpoint)"


class ConfigError(ValueError):
    """Bad input. The message names the key and the value.

    Raised in a DataLoader worker (say, for a file that cannot be decoded), it reaches the training process
    re-raised by the loader, with the worker's traceback as its message (torch.utils.data._utils.ExceptionWrapper):
    only the traceback's last line, ours, is kept.
    """

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__} in DataLoader worker"):
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


def first_line(error: BaseException) -> str:
    """An exception's message, first line only (its type's name when it has none): the reason in a one-line error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def require(condition: bool, message: str) -> None:
    """Raises ConfigError(message) unless `condition`: the checks' one-liner."""
    if not condition:
        raise ConfigError(message)


class TrainingDiverged(FloatingPointError):
    """The loss became NaN or infinite. The message names the step and rank; the last checkpoint is intact."""


class StorageError(RuntimeError):
    """A write into the run directory failed (no space left, quota, permission, read-only file system, file-size
    limit). The message names the path and the cause; the checkpoints written before are intact."""


class WorkerFailed(RuntimeError):
    """A rank of a spawned job failed. The message names the rank; its traceback is in the job log."""


def peer_gone(error: BaseException) -> bool:
    """Whether a collective failed because another rank is gone (gloo's and NCCL's words for it)."""
    text = str(error)
    return any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator")
    )


def unwrap_instantiation(error: BaseException) -> BaseException:
    """hydra.utils.instantiate wraps what a constructor raises; the constructor's own error is the cause."""
    return error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error


@contextmanager
def exit_on_error() -> Iterator[None]:
    """Turns the errors above into one logged line and a non-zero exit; anything else propagates."""
    try:
        yield
    except (ConfigError, InstantiationException) as error:
        cause = unwrap_instantiation(error)
        if not isinstance(cause, ConfigError):
            raise
        log.error("%s", cause)
        sys.exit(BAD_INPUT_EXIT_CODE)
    except (WorkerFailed, TrainingDiverged) as error:
        log.error("%s", error)
        sys.exit(FAILED_EXIT_CODE)
    except StorageError as error:
        log.error("%s", error)
        sys.exit(STORAGE_EXIT_CODE)
    except Interrupted as error:
        stop_taken()
        log.error("%s", error)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:  # Ctrl-C (hydraloop.preemption.interrupt_once), said as the other stops are
        stop_taken()
        error = Interrupted(signal.SIGINT, CTRL_C)
        log.error("%s", error)
        sys.exit(error.exit_code)
    except Exception as error:
        if not getattr(error, "logged", False):
            raise
        # A failure in a rank run in this process, whose traceback is logged already: said once, as for spawned ranks.
        log.error(
            "training failed: %s: %s (its traceback is above, and in the job log)",
            type(error).__name__,
            first_line(error),
        )
        sys.exit(FAILED_EXIT_CODE)
