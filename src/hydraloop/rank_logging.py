import logging
import sys

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-logging format


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
    if rank != 0:
        root.setLevel(logging.WARNING)
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter(FORMAT.replace("[%(name)s]", f"[rank {rank}][%(name)s]")))
