"""Files of arrays as tensors by name: a numpy `.npz` or torch `.pt` (read without running code), or a `.csv` or
`.parquet` table split into feature columns and a target column. Anything wrong with a file is one line naming the
config key (`where`), the value and what was found. For data=tensors and mode=predict's inputs.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydraloop.errors import ConfigError, first_line

SUFFIXES = (".npz", ".pt", ".csv", ".parquet")
TABLES = (".csv", ".parquet")
NPZ_START, NPY_START = b"PK\x03\x04", b"\x93NUMPY"[:4]  # a zip's first bytes (np.savez's), a .npy's (np.save's)


def read_arrays(path: Path, where: str) -> dict[str, torch.Tensor]:
    """A .npz or .pt file's arrays as tensors, by name (`where` names the config key in errors)."""
    suffix = _check_path(path, where)
    with path.open("rb") as file:
        start = file.read(len(NPZ_START))
    if suffix == ".npz" and start not in (NPZ_START, NPY_START):  # numpy reads anything else as a pickle
        found = f"it starts {start!r}" if start else "it is empty"
        raise ConfigError(f"{where}: not a .npz file (a zip of .npy arrays, as np.savez writes); {found}")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                loaded: Any = {key: npz[key] for key in npz.files}
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt or foreign file: say so in one line, without the unpickler's story
        raise ConfigError(f"{where}: cannot be read as {suffix}: {_reason(error)}") from error
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{where}: holds a {type(loaded).__name__}; a .pt file must hold a dict of tensors")
    arrays = {}
    for key, value in loaded.items():
        if isinstance(value, np.ndarray):
            try:
                value = torch.from_numpy(value)
            except TypeError:
                raise ConfigError(f"{where}: '{key}' has dtype {value.dtype}, which is not numeric") from None
        arrays[str(key)] = value  # anything else is rejected by its reader (data=tensors' _checked), if a key it uses
    return arrays


def read_table(path: Path, where: str, x_key: str, y_key: str, columns: Sequence[str] | None) -> dict:
    """A .csv or .parquet table as {x_key: the feature columns (N, F), y_key: the target column (N,)}."""
    suffix = _check_path(path, where)
    try:
        if suffix == ".csv":
            import csv

            with path.open(newline="") as file:
                rows = list(csv.reader(file))
            header, body = (rows[0], rows[1:]) if rows else ([], [])
            table = {name: [row[index] for row in body] for index, name in enumerate(header)}
        else:
            import pyarrow.parquet

            table = pyarrow.parquet.read_table(path).to_pydict()
    except ImportError:
        raise ConfigError(f"{where}: reading parquet needs pyarrow; pip install pyarrow (in the hf extra)") from None
    except Exception as error:  # noqa: BLE001  a corrupt or foreign file: one line
        raise ConfigError(f"{where}: cannot be read as {suffix}: {first_line(error)}") from None
    names = list(table)
    if y_key not in table:
        raise ConfigError(f"{where}: no column '{y_key}' (data.dataset.y_key); it has {quoted(names) or 'none'}")
    features = list(columns) if columns is not None else [name for name in names if name != y_key]
    unknown = [name for name in features if name not in table]
    if unknown or not features:
        raise ConfigError(
            f"data.dataset.feature_columns={list(features)}: "
            + (f"no column {quoted(unknown)}; " if unknown else "no feature columns; ")
            + f"it has {quoted(names)}"
        )
    return {x_key: _column_array(table, features, where), y_key: _column_array(table, [y_key], where)[:, 0]}


def _column_array(table: dict, names: list[str], where: str) -> torch.Tensor:
    """Columns as one tensor (N, len(names)): int64 where every column holds integers, else float64."""
    columns = []
    for name in names:
        for convert in (_integer, float):
            try:
                columns.append(np.array([convert(value) for value in table[name]]))
                break
            except (TypeError, ValueError):
                continue
        else:
            example = next((v for v in table[name] if not _is_number(v)), table[name][0])
            raise ConfigError(f"{where}: column '{name}' holds values that are not numbers, e.g. {example!r}")
    return torch.from_numpy(np.stack(columns, axis=1))


def _integer(value: Any) -> int:
    """An integer as a table holds it (an int, or a csv's digits), never a float cut short."""
    if isinstance(value, (bool, float)) or not isinstance(value, (int, np.integer, str)):
        raise TypeError(value)
    return int(value)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _reason(error: Exception) -> str:
    """Why a file could not be loaded. torch's weights-only refusal spans a page, the cause on one line of it."""
    text = str(error)
    if text.startswith("Object arrays cannot be loaded"):  # numpy's advice is to allow pickles: not here
        return "it holds an object array (Python objects), which loading without running code refuses; save numbers"
    unpickler = next((line for line in text.splitlines() if "WeightsUnpickler error:" in line), None)
    if unpickler is None:
        return first_line(error)
    cause = unpickler.split("WeightsUnpickler error:", 1)[1].split(". Please use")[0].strip()
    return f"it holds more than tensors, which loading without running code refuses ({cause}); save a dict of tensors"


def _check_path(path: Path, where: str) -> str:
    """The file's suffix, once it is known to be a file of a kind read here."""
    if not path.is_file():
        absolute = f" ({path.resolve()})" if not path.is_absolute() else ""
        problem = "a directory, not a file" if path.is_dir() else "no such file"
        raise ConfigError(f"{where}: {problem}{absolute}")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"{where}: unsupported file type '{suffix or path.name}'; use {' or '.join(SUFFIXES)}")
    return suffix


def quoted(keys: Sequence[str]) -> str:
    """Names as a message quotes them: 'x', 'y'."""
    return ", ".join(f"'{key}'" for key in keys)
