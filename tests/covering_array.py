"""All-pairs covering arrays: few rows in which every pair of values of two axes appears at least once.

Greedy and deterministic (AETG's construction, without its random candidates): each row starts from the first pair
not yet covered, then takes, axis by axis, the value that covers the most pairs not yet covered with the values
already chosen (the first such value on a tie). `allowed(row)` says whether a partial row may stand; a pair no
allowed row can hold is not required. Every axis needs a value that every value of every other axis allows (such as
"none"), so that a row can always be completed.
"""

from collections.abc import Callable
from itertools import combinations
from typing import Any

Pair = tuple[tuple[str, Any], tuple[str, Any]]


def covering_array(axes: dict[str, list], allowed: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    names = list(axes)
    uncovered: list[Pair] = [
        ((a, x), (b, y)) for a, b in combinations(names, 2) for x in axes[a] for y in axes[b] if allowed({a: x, b: y})
    ]
    rows = []
    while uncovered:
        (a, x), (b, y) = uncovered[0]
        row = {a: x, b: y}
        for name in names:
            if name in row:
                continue
            choices = [value for value in axes[name] if allowed({**row, name: value})]
            gains = [_gain(row, name, value, uncovered) for value in choices]
            row[name] = choices[gains.index(max(gains))]  # the first of the best
        assert allowed(row), row
        rows.append(row)
        uncovered = [pair for pair in uncovered if not _holds(row, pair)]
    return rows


def _gain(row: dict[str, Any], name: str, value: Any, uncovered: list[Pair]) -> int:
    """The pairs not yet covered that `name=value` would cover with the values chosen so far."""
    return sum(
        1
        for pair in uncovered
        if (name, value) in pair and all(row.get(axis, value if axis == name else object()) == v for axis, v in pair)
    )


def _holds(row: dict[str, Any], pair: Pair) -> bool:
    return all(row[axis] == value for axis, value in pair)


def uncovered_pairs(axes: dict[str, list], allowed: Callable[[dict], bool], rows: list[dict]) -> list[Pair]:
    """The pairs some allowed row could hold that none of `rows` holds: [] for a covering array."""
    return [
        ((a, x), (b, y))
        for a, b in combinations(list(axes), 2)
        for x in axes[a]
        for y in axes[b]
        if allowed({a: x, b: y}) and not any(row[a] == x and row[b] == y for row in rows)
    ]
