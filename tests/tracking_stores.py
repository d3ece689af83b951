"""Reading back what the loggers wrote, through each tool's own format: W&B's offline run files, MLflow's tracking
client, TensorBoard's event files and HParams plugin data; and a bad-input check for runs in the test's process."""

import csv
import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata


def isolate_wandb(monkeypatch, root: Path) -> None:
    """W&B's settings, cache and credentials away from the user's: no API key, no ~/.netrc, so runs are offline."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(root / name.lower()))
    monkeypatch.setenv("NETRC", str(root / "no-netrc"))


# --- W&B: the offline run's transaction log ----------------------------------------------------------------------

LOG_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version
RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """An offline run as W&B recorded it: what `wandb sync` would upload."""

    path: Path
    run_id: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per committed step, with "_step"
    summary: dict = field(default_factory=dict)
    preempting: bool = False  # marked preempted (wandb's run.mark_preempting)
    exit_code: int | None = None  # None: the run was never finished (no exit record)


def wandb_runs(run_dir: Path) -> list[WandbRun]:
    return [read_wandb_run(path) for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))]


def read_wandb_run(path: Path) -> WandbRun:
    """Parses the `.wandb` file: LevelDB's log format (32 KiB blocks of checksummed records, long records split in
    pieces) holding W&B's protobuf `Record`s; the same reader W&B's own sync uses."""
    from wandb.proto import wandb_internal_pb2

    run = WandbRun(path)
    for payload in _log_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.group = record.run.run_id, record.run.project, record.run.run_group
            run.tags = list(record.run.tags)
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
        elif kind == "preempting":
            run.preempting = True
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def _log_records(data: bytes):
    ident, magic, _ = LOG_HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a W&B transaction log"
    position, pieces = LOG_HEADER.size, b""
    while position + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < RECORD_HEADER.size:  # the block's tail is padding
            position += left_in_block
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, position)
        position += RECORD_HEADER.size
        payload, position = data[position : position + length], position + length
        if kind == FULL:
            yield payload
        elif kind in (FIRST, MIDDLE):
            pieces = (pieces if kind == MIDDLE else b"") + payload
        elif kind == LAST:
            yield pieces + payload
        else:  # zeros: the rest of the block is padding
            position += (BLOCK - position % BLOCK) % BLOCK


# --- MLflow ------------------------------------------------------------------------------------------------------


def mlflow_runs(tracking_uri: str, experiment_name: str) -> list:
    """The experiment's runs, oldest first, through MLflow's own client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None, f"no MLflow experiment {experiment_name!r}"
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {metric.step: metric.value for metric in MlflowClient(tracking_uri).get_metric_history(run_id, key)}


# --- CSV and TensorBoard ------------------------------------------------------------------------------------------


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with (Path(run_dir) / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def events(run_dir: Path) -> EventAccumulator:
    return EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0}).Reload()


def hparams_row(run_dir: Path) -> tuple[list[str], list[str], dict]:
    """The run's HParams declaration (hyper-parameter names, metric names) and its own hyper-parameter values."""
    content = events(run_dir).PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    session = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    names = [info.name for info in experiment.hparam_infos]
    metrics = [info.name.tag for info in experiment.metric_infos]
    values = {}
    for key, value in session.hparams.items():
        kind = value.WhichOneof("kind")
        values[key] = getattr(value, kind)
    return names, metrics, values


def event_files(run_dir: Path) -> list[str]:
    """Every event file under the run's tensorboard/ folder, sub-folders included, relative to it."""
    root = Path(run_dir) / "tensorboard"
    return sorted(str(path.relative_to(root)) for path in root.rglob("events.out.tfevents.*"))


def rejected_in_process(train_in_process, tmp_path: Path, caplog, *overrides: str) -> str:
    """The one error line of a `train_in_process` run refused as bad input (exit code 2), after checking that its
    run directory stayed empty."""
    with pytest.raises(SystemExit) as exit_info:
        train_in_process(*overrides)
    assert exit_info.value.code == 2
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    written = [path for folder in tmp_path.iterdir() if folder.is_dir() for path in folder.rglob("*") if path.is_file()]
    assert not written, written  # into the run directory (removed, since it was left empty), or anywhere in it
    return errors[0]
