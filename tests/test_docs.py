"""README.md and docs/: every relative link and anchor leads somewhere, and every training command README shows passes
the launcher's checks as written (its worked examples run in test_readme_example.py)."""

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO
from hydraloop.checks.command_line import check_command_line

pytestmark = pytest.mark.fast  # composing and checking configs: the fast tier

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces as -."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_and_anchor_leads_somewhere(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading in {file.name}")
    assert not broken, broken


def readme_training_commands() -> list[list[str]]:
    """The overrides of each `python src/train.py ...` line in README's bash blocks (torchrun's included)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "src/train.py" in words:
                commands.append(words[words.index("src/train.py") + 1 :])
    return commands


def test_readme_shows_training_commands():
    assert len(readme_training_commands()) >= 8


@pytest.mark.parametrize("overrides", readme_training_commands(), ids=" ".join)
def test_every_training_command_in_the_readme_passes_the_launchers_checks(overrides, monkeypatch, data_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
    monkeypatch.syspath_prepend(str(REPO / "src"))
    from train import check_job

    # As written; a single run is checked as one job of a sweep is (-m), the path that checks its whole config.
    check_command_line(overrides if "-m" in overrides else ["-m", *overrides], REPO / "conf", check_job)
