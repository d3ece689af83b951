import logging
import sys

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-logging format
JOB_LOG_ONLY = {"job_log_only": True}
"""`log.info(..., extra=JOB_LOG_ONLY)`: a record for the job log, not the console (the resolved config: a page)."""


class _NotJobLogOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "job_log_only", False)


_CONSOLE_FILTER = _NotJobLogOnly()


def setup_rank_logging(rank: int, log_file: str) -> None:
    """Rank 0 logs at INFO to the console and the job log; other ranks log only warnings and errors, prefixed.

    A worker started by the DDP strategy is a fresh interpreter that Hydra never configured: it gets the same
    console and job-log handlers as the launcher, appending to the launcher's log file.
    """
    root = logging.getLogger()
    if not root.handlers:
        for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(log_file)):
            handler.setFormatter(logging.Formatter(FORMAT))
            root.addHandler(handler)
        root.setLevel(logging.INFO)
    for handler in root.handlers:
        if not isinstance(handler, logging.FileHandler) and _CONSOLE_FILTER not in handler.filters:
            handler.addFilter(_CONSOLE_FILTER)
    if rank != 0:
        root.setLevel(logging.WARNING)
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter(FORMAT.replace("[%(name)s]", f"[rank {rank}][%(name)s]")))
