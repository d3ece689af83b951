"""Write a sharded checkpoint (parallel=fsdp's directory of shards) as one file that plain
`torch.load(path, weights_only=True)` reads, on any machine, without hydraloop or a process group.

    python scripts/consolidate.py outputs/DATE/TIME/checkpoints/best.pt best-whole.pt

The file holds what a single-process run's checkpoint holds, in its format (the model's state_dict, each optimizer's
state keyed by position, the training state, config and metrics), so every strategy, `mode=eval`, `mode=predict`
and the scripts read it as they read one written by training. It is read whole into this process's memory and
written under a temporary name, then renamed: an existing file is never overwritten. Bad input is one line on stderr
and exit 2.
"""

import argparse
import sys
from pathlib import Path

from hydraloop.checkpoint import load_checkpoint, save_atomic
from hydraloop.errors import BAD_INPUT_EXIT_CODE, ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint, e.g. checkpoints/last.pt (a directory)")
    parser.add_argument("out", type=Path, help="the file to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        consolidate(args.checkpoint, args.out)
    except ConfigError as error:
        print(f"consolidate.py: {error}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    print(f"wrote {args.out}: step {load_checkpoint(args.out)['global_step']}, one file")
    return 0


def consolidate(checkpoint: Path, out: Path) -> None:
    if not checkpoint.is_dir():
        raise ConfigError(f"{checkpoint}: not a sharded checkpoint (a directory); a file is already one file")
    if out.exists():
        raise ConfigError(f"{out}: exists; name a new file (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(load_checkpoint(checkpoint, source=str(checkpoint)), out)


if __name__ == "__main__":
    sys.exit(main())
