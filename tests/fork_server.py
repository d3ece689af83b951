"""A process that has imported what src/train.py imports first (torch, torch._dynamo, Hydra: about half of a refused
command's 3 s) and forks a child for each command it is sent, which runs src/train.py as `python src/train.py ARGS`
would: its own process, its own arguments, working directory, output and exit code, atexit handlers run. The bad-input
tests send their rows here (conftest's `run_refused`), since most of each row's time went to importing torch.

Protocol, one JSON line per command on stdin: {"args": [...], "cwd": ..., "output": path}; the reply, one line on
stdout: {"returncode": N}. Its environment is the command's (conftest's train_env): a row needing another one runs
as a plain subprocess.
"""

import gc

gc.disable()  # as src/train.py does while it imports

import atexit
import json
import os
import runpy
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
            sys.stdin.close()
            run_child(request["args"], request["cwd"], request["output"])
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
