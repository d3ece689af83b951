"""Writes a labelled text data set from the bundled corpus, with no download: which play a line of Shakespeare is from.

    python scripts/make_play_lines.py [OUT.csv]

OUT (default: $XDG_CACHE_HOME/hydraloop/play_lines.csv, where experiment=hf_finetune looks) gets a csv with the
columns `text` (one spoken line of verse or prose) and `label` (hamlet, macbeth or romeo_and_juliet), from the three
plays of data=text's default corpus, in the corpus's order: data=hf holds out its validation lines by
data.dataset.val_fraction. Speakers' names, stage directions and headings are left out. An existing OUT is left as
it is; it is written under a temporary name and renamed, so it is complete whenever it exists.
"""

import argparse
import csv
import os
import re
import tempfile
from pathlib import Path

from hydraloop.data.text import corpus_path

DEFAULT_OUT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydraloop" / "play_lines.csv"
# Each play's heading in the bundled corpus, and its label.
PLAYS = {"ROMEO AND JULIET": "romeo_and_juliet", "HAMLET, PRINCE OF DENMARK": "hamlet", "MACBETH": "macbeth"}
SPEAKER = re.compile(r"^[A-Z][\w']*( [A-Z][\w']*)*\.$")  # "Sampson.", "Mar.", "First Witch.", "MACBETH."
DIRECTION = re.compile(r"\[[^\]]*\]?")  # "[Knocking within.]", or the start of one that goes on


def play_lines() -> list[tuple[str, str]]:
    """(line, label) for every spoken line of the three plays."""
    rows, label, speaking = [], None, False
    for line in corpus_path(None).read_text().splitlines():
        stripped = line.strip()
        if stripped in PLAYS:
            label, speaking = PLAYS[stripped], False
        elif SPEAKER.match(stripped):
            speaking = True
        elif not stripped:
            speaking = False  # a blank line ends a speech
        elif speaking and label:
            spoken = DIRECTION.sub("", stripped).strip()
            if spoken and not stripped.startswith("["):
                rows.append((spoken, label))
    return rows


def write_play_lines(out: Path) -> Path:
    """Writes the csv (unless `out` exists); returns `out`."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    with os.fdopen(handle, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        writer.writerows(play_lines())
    os.replace(tmp, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"the csv (default: {DEFAULT_OUT})")
    out = write_play_lines(parser.parse_args().out)
    print(f"{out}: {sum(1 for _ in out.open()) - 1} lines")


if __name__ == "__main__":
    main()
