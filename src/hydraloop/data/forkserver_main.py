"""Imported first by a data loader's fork server (hydraloop.data.loaders), before it forks any worker: what CPython's
fork server means to do with the preload entry `__main__` and does not (3.11 to 3.13 pass it neither the main path
nor the sys.path they compute). With the sys.path and the entrypoint of the process that started it (given in
HYDRALOOP_FORKSERVER_MAIN while it starts), the server holds the entrypoint's imports, and a worker forked from it
finds its `__main__` imported: without this, every worker imported the entrypoint, torch and Hydra included, anew
(3-4 s of CPU each on a busy machine, at the first training and the first validation batch of every rank).

The server, and the workers it forks, leave the rank's process group for a session of their own: a stop signal to
the run's group (a terminal's Ctrl-C, `kill -TERM -PGID`) is the rank's, which stops its loaders. It ended the
workers at once, and the rank failed where it would have written a checkpoint and stopped (exit 143 all the same,
with no checkpoint). The rank still ends them as it exits, and they end with it however it ends
(hydraloop.data.workers). It ignores the stop signals, which its workers inherit: a scheduler may send them to every
process of a job (hydraloop.data.workers says why)."""

import contextlib
import json
import os
import signal
import sys
from multiprocessing import spawn

ENV = "HYDRALOOP_FORKSERVER_MAIN"

_given = os.environ.pop(ENV, None)
if _given:  # in the server, not in the rank that imports this module too
    with contextlib.suppress(OSError):  # a process group's leader already: not started by a rank
        os.setsid()
    try:
        _given = json.loads(_given)
        sys.path[:] = _given["sys_path"]
        if _given.get("main_path"):
            spawn.import_main_path(_given["main_path"])
    except Exception:  # noqa: BLE001  a server must start: its workers then import the entrypoint themselves
        pass
    # After the entrypoint, which may set handlers of its own.
    ignored = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)  # blocked while the server started
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
