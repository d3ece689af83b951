"""Lightning as a peer (the `bench` extra, `pip install 'hydraloop[bench]'`): the loop users of
lightning-hydra-template run. (e) Its Trainer on the same model, optimizer and batches as benchmark_loops' two loops,
with its logger, checkpoints and progress bar off and with its defaults; and a whole short run from the command line,
start-up to exit, against `python src/train.py`. Imported by benchmark.py."""

import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark_loops import (
    DEFAULT_THREADS,
    SMOKE_BATCHES,
    WORKLOADS,
    compose_config,
    datasets,
    hydraloop_epoch,
    smoke_overrides,
    timed,
)
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from hydraloop.optim import optimizer_factory

REPO = Path(__file__).resolve().parents[1]


def available() -> bool:
    return importlib.util.find_spec("lightning") is not None


def lightning_epoch_rates(cfg, device: torch.device, defaults: bool, epochs: int) -> float:
    """Samples per second of one `Trainer.fit` over `epochs` + 1 epochs, the first (warm-up) left out: the time from
    each epoch's start to the next's (or the end), so with `defaults` a checkpoint and the logger's writes count."""
    import lightning as L

    torch.set_num_threads(cfg.trainer.cpu_threads or DEFAULT_THREADS)
    train_set, _ = datasets(cfg, dict_batches=False)
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    steps = min(len(loader), cfg.trainer.limit_train_batches or len(loader))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(cfg.seed)
            self.model = instantiate(cfg.model)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs).flatten(0, -2), targets.flatten())

        def configure_optimizers(self):
            return optimizer_factory(cfg.optimizer)(self.parameters())

    class EpochTimes(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_epoch_start(self, trainer, module) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, module) -> None:
            self.starts.append(time.perf_counter())

    times = EpochTimes()
    quiet = {} if defaults else dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            max_epochs=epochs + 1,
            limit_train_batches=steps,
            enable_model_summary=False,
            callbacks=[times],
            default_root_dir=tmp,
            **quiet,
        )
        trainer.fit(Module(), loader)
    return epochs * steps * cfg.data.batch_size / (times.starts[-1] - times.starts[1])


def lightning_throughput(args, device: torch.device) -> list[dict]:
    """(e): hydraloop's loop against Lightning's Trainer on the same model and batches, in one process, samples taken
    in turn; Lightning quiet (no logger, checkpoints or progress bar) and with its defaults."""
    rows = []
    for name in args.lightning_workloads:
        cfg = compose_config([*WORKLOADS[name], f"trainer.precision={args.precision}", *smoke_overrides(args)])
        hydraloop = hydraloop_epoch(cfg, device)
        hydraloop()  # warm-up
        start = time.perf_counter()
        hydraloop()
        epochs = 1 if args.smoke else max(1, math.ceil(0.5 / (time.perf_counter() - start)))
        samples = {"hydraloop": [], "Lightning, quiet": [], "Lightning, defaults": []}
        for _ in range(args.repeats):
            samples["hydraloop"].append(timed(hydraloop, device, epochs))
            samples["Lightning, quiet"].append(lightning_epoch_rates(cfg, device, defaults=False, epochs=epochs))
            samples["Lightning, defaults"].append(lightning_epoch_rates(cfg, device, defaults=True, epochs=epochs))
        ratios = {
            label: statistics.median(ours / theirs for ours, theirs in zip(samples["hydraloop"], samples[label]))
            for label in ("Lightning, quiet", "Lightning, defaults")
        }
        rows.append(
            {
                "workload": name,
                "ratio_vs_quiet": ratios["Lightning, quiet"],
                "ratio_vs_defaults": ratios["Lightning, defaults"],
                "samples_per_s": {k: statistics.median(v) for k, v in samples.items()},
                "samples": samples,
            }
        )
    return rows


LIGHTNING_DIGITS_RUN = """
import lightning as L, torch, torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

x, y = load_digits(return_X_y=True)
x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=0)
def loader(x, y, shuffle):
    data = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
    return DataLoader(data, batch_size=64, shuffle=shuffle, drop_last=shuffle)

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                         torch.nn.ReLU(), torch.nn.Linear(128, 10))
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.model(batch[0]), batch[1])
    def validation_step(self, batch, batch_idx):
        self.log("val/acc", (self.model(batch[0]).argmax(1) == batch[1]).float().mean())
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

L.Trainer(max_epochs=1, limit_train_batches=LIMIT, accelerator="cpu", default_root_dir=ROOT).fit(
    Module(), loader(x_train, y_train, True), loader(x_val, y_val, False)
)
"""


def command_line_runs(args) -> dict:
    """A 1-epoch digits run, start-up to exit, each with its defaults (TensorBoard logs, a checkpoint): hydraloop's
    `python src/train.py trainer.max_epochs=1` and the same MLP, data and optimizer under Lightning's Trainer."""
    times: dict[str, list[float]] = {"hydraloop": [], "Lightning": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            hydraloop = [sys.executable, str(REPO / "src" / "train.py"), "trainer.max_epochs=1", *smoke_overrides(args)]
            hydraloop.append(f"hydra.run.dir={tmp}/hydraloop_{repeat}")
            script = LIGHTNING_DIGITS_RUN.replace("ROOT", repr(f"{tmp}/lightning_{repeat}"))
            lightning = [sys.executable, "-c", script.replace("LIMIT", str(SMOKE_BATCHES if args.smoke else 1.0))]
            for label, command in (("hydraloop", hydraloop), ("Lightning", lightning)):
                start = time.perf_counter()
                subprocess.run(command, cwd=REPO, check=True, capture_output=True)
                times[label].append(time.perf_counter() - start)
    hydraloop_s, lightning_s = (statistics.median(times[label]) for label in times)
    return {
        "hydraloop_s": hydraloop_s,
        "lightning_s": lightning_s,
        "ratio": lightning_s / hydraloop_s,
        "samples": times,
    }
