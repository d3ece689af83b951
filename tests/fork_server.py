"""A process that has imported what src/train.py imports first (torch, torch._dynamo, Hydra: about half of a refused
command's 3 s) and forks a child for each command it is sent, which runs src/train.py as `python src/train.py ARGS`
would: its own process, its own arguments, working directory, output and exit code, atexit handlers run; ranks it
starts are forked or spawned as from the command line. conftest's `run_train` and `run_refused` send their commands
here, since importing torch was most of a refused command's time and a third to a half of a short run's.

Protocol, one JSON line per command on stdin: {"args": [...], "cwd": ..., "output": path, "timeout": seconds or null};
the reply, one line on stdout: {"returncode": N}, or {"timeout": true} for a command killed (as subprocess.run kills
it) when it ran past its timeout. Its environment is the commands' (conftest's train_env): a command needing another
one, a wrapper or a preexec_fn runs as a plain subprocess.
"""

import gc

gc.disable()  # as src/train.py does while it imports

import atexit
import json
import os
import runpy
import select
import signal
import sys
import traceback

import hydra  # noqa: F401
import omegaconf  # noqa: F401
import torch  # noqa: F401  imported only: no thread pool is started before the forks
import torch._dynamo  # noqa: F401

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src", "train.py")


def run_child(args: list[str], cwd: str, output: str) -> None:
    """In the forked child: src/train.py with `args`, its output into the file `output`; never returns."""
    code = 1
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(cwd)
        gc.enable()  # the state src/train.py starts from; it disables the collector itself
        sys.argv = [os.path.abspath(TRAIN), *args]
        sys.path[0] = os.path.dirname(os.path.abspath(TRAIN))  # as `python src/train.py` sets it
        try:
            runpy.run_path(os.path.abspath(TRAIN), run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  as the interpreter would: the traceback, exit 1
            traceback.print_exc()
        atexit._run_exitfuncs()  # noqa: SLF001  logging's flush and hydraloop's handlers, as at a normal exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            # The request pipe must not stay the child's stdin, and fd 0 must not be left free: the next file the
            # child opens would take it, and a process it starts (DataLoader's forkserver) would read it as stdin.
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            run_child(request["args"], request["cwd"], request["output"])
        print(json.dumps(wait_for_child(pid, request.get("timeout"))), flush=True)


def wait_for_child(pid: int, timeout: float | None) -> dict:
    """The child's exit code, or (killing it, as subprocess.run does) a timeout."""
    child = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([child], [], [], timeout)
        if not ended:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(child)
    return {"returncode": os.waitstatus_to_exitcode(status)} if ended else {"timeout": True}


if __name__ == "__main__":
    main()
