"""scripts/gpu_check.sh runs on the rare day a GPU is lent: its training commands must not rot in between. Each one
passes the launcher's checks here, on the CPU (the device is the only override the CPU changes), without training."""

import importlib.util

import pytest

from conftest import REPO
from hydraloop.checks.command_line import check_command_line

pytestmark = pytest.mark.fast  # composing and checking configs: the fast tier

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

COMMANDS = {
    "{strategy}-{precision}-compile_{compile}".format(**variant): overrides
    for variant, overrides in gpu_check.run_variants("cpu", epochs=1)
}
COMMANDS["text_gpt bf16 compiled (CPU dry run)"] = gpu_check.gpt_overrides("cpu")
COMMANDS["text_gpt bf16 compiled (GPU)"] = [
    "device=cpu" if item.startswith("device=") else item for item in gpu_check.gpt_overrides("cuda")
]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_training_command_of_the_gpu_check_passes_the_launchers_checks(name, monkeypatch, data_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(data_cache))
    monkeypatch.syspath_prepend(str(REPO / "src"))
    from train import check_job  # src/train.py's checks of one job, as a sweep runs them before any job starts

    # As one job of a sweep (-m): the path through which the launcher checks a job's whole resolved config.
    check_command_line(["-m", *COMMANDS[name]], REPO / "conf", check_job)
