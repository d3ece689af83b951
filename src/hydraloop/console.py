"""Rank 0's console: a progress bar on a terminal; elsewhere (files, CI logs) the interval log lines alone."""

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


@contextmanager
def progress_bar(total_steps: int, done_steps: int, enabled: bool = True) -> Iterator[tqdm]:
    """A bar over all optimizer steps of the run (rate and ETA from tqdm). Disabled, it is a no-op object.

    While it is shown, log records are written above it instead of tearing it.
    """
    enabled = enabled and sys.stdout.isatty()
    # shutil falls back to 80x24 where a terminal reports a size of 0 (tqdm would then draw nothing).
    columns, lines = shutil.get_terminal_size()
    bar = tqdm(
        total=total_steps,
        initial=done_steps,
        unit="step",
        ncols=columns,
        nrows=lines,
        disable=not enabled,
        file=sys.stdout,
    )
    with logging_redirect_tqdm() if enabled else nullcontext():
        try:
            yield bar
        finally:
            bar.close()
