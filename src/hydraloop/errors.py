"""The two ways a run ends in error without a Python traceback: bad input, and a failed rank."""

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from hydra.errors import InstantiationException

log = logging.getLogger("hydraloop")

BAD_INPUT_EXIT_CODE = 2
FAILED_EXIT_CODE = 1


class ConfigError(ValueError):
    """Bad input. The message names the key and the value."""


class WorkerFailed(RuntimeError):
    """A rank of a spawned job failed. The message names the rank; its traceback is in the job log."""


@contextmanager
def exit_on_error() -> Iterator[None]:
    """Turns ConfigError and WorkerFailed into one logged line and a non-zero exit; anything else propagates."""
    try:
        yield
    except (ConfigError, InstantiationException) as error:
        # hydra.utils.instantiate wraps what a constructor raises; unwrap our own errors.
        cause = error if isinstance(error, ConfigError) else error.__cause__
        if not isinstance(cause, ConfigError):
            raise
        log.error("%s", cause)
        sys.exit(BAD_INPUT_EXIT_CODE)
    except WorkerFailed as error:
        log.error("%s", error)
        sys.exit(FAILED_EXIT_CODE)
