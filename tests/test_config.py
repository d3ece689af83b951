"""The config tree composes and instantiates in every combination; loaders and seeds split work over ranks."""

import itertools

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from conftest import REPO, compose_train
from hydraloop.arguments import check_arguments, check_model, check_optimization
from hydraloop.data.loaders import build_loaders
from hydraloop.data.samplers import ShardSampler
from hydraloop.optim import config_key, optimizer_factory, optimizer_nodes
from hydraloop.seeding import epoch_seed

pytestmark = pytest.mark.fast  # composing and checking configs: the fast tier

PARALLEL = ("single", "dataparallel", "ddp")
DATA = ("digits", "mnist1d", "synthetic")
MODELS = ("mlp", "cnn")
OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.05), "adamw": (torch.optim.AdamW, 0.003)}


@pytest.mark.parametrize(
    "parallel, data, model, optimizer", list(itertools.product(PARALLEL, DATA, MODELS, OPTIMIZERS))
)
def test_every_combination_composes(parallel, data, model, optimizer):
    cfg = compose_train(f"parallel={parallel}", f"data={data}", f"model={model}", f"optimizer={optimizer}")
    assert cfg.parallel._target_.startswith("hydraloop.parallel.")
    assert cfg.data.dataset._target_.startswith(f"hydraloop.data.{data}.")
    assert cfg.model._target_.startswith(f"hydraloop.models.{model}.")
    assert cfg.optimizer._target_ == f"torch.optim.{OPTIMIZERS[optimizer][0].__name__}"
    assert list(cfg.model.input_shape) == list(cfg.data.input_shape)
    assert cfg.model.num_classes == cfg.data.num_classes == 10


SHIPPED_OPTIONS = [
    f"{group}={path.stem}"
    for group in ("parallel", "data", "task", "model", "optimizer", "scheduler", "experiment")
    for path in sorted((REPO / "conf" / group).glob("*.yaml"))
]
NEEDS = {  # the values an option requires (???), or the data it is meant for
    "data=tensors": ["data.dataset.path=/nowhere.pt", "data.input_shape=[4]", "data.num_classes=2"],
    "data=image_folder": ["data.dataset.root=/nowhere", "data.num_classes=10"],  # else counted there: 0
    "experiment=imagenet_resnet50": ["data.dataset.root=/nowhere", "data.num_classes=1000"],
    "model=gpt": ["data=text", "task=language_model"],
    "model=hf": ["model.model_type=gpt2", "data=text", "task=language_model"],
    "data=hf": ["data.dataset.path=/nowhere.csv", "data.num_classes=2"],
    # The vocabulary size given, not read from a tokenizer (test_hf_data.py reads one).
    "data=hf_lm": [
        *["data.dataset.path=/nowhere.txt", "data.vocab_size=300"],
        *["model=hf", "model.model_type=gpt2", "task=language_model"],
    ],
    "data=tokens": ["data.dataset.dir=TOKENS", "model=gpt", "task=language_model"],
    "experiment=nanogpt_shakespeare_char_cpu": ["data.dataset.dir=TOKENS"],
    "experiment=gpt2_124m": ["data.dataset.dir=TOKENS"],
    "experiment=shakespeare_bpe": ["data.dataset.dir=TOKENS"],
    "experiment=hf_pretrain": ["data.dataset.dir=TOKENS"],
    # Its export is made by experiment=hf_pretrain (test_hf_recipe.py): here the architecture alone, no tokenizer.
    "experiment=hf_finetune": ["model.name_or_path=null", "model.model_type=gpt2", "data.dataset.tokenizer=null"],
    "task=adversarial_ring": ["data=ring", "model=gan", "optimizer=gan"],
}


@pytest.mark.parametrize("option", SHIPPED_OPTIONS)
def test_every_shipped_option_passes_the_launchers_checks_of_keys_and_values(option, token_folder):
    """arguments.check_arguments refuses a key its node's _target_ does not take, check_model and check_optimization a
    value the model, the optimizer or the scheduler refuses; no shipped config has either (the refusals themselves:
    test_bad_input.py)."""
    needs = [value.replace("TOKENS", str(token_folder)) for value in NEEDS.get(option, [])]
    cfg = OmegaConf.create(OmegaConf.to_container(compose_train(option, *needs), resolve=True))
    check_arguments(cfg)
    check_model(cfg.model)
    for name, node in optimizer_nodes(cfg.optimizer).items():
        check_optimization(node, cfg.scheduler, key=config_key(name))


@pytest.mark.parametrize("data, model", list(itertools.product(DATA, MODELS)))
def test_model_forward_on_data_shape(data, model):
    cfg = compose_train(f"data={data}", f"model={model}")
    net = instantiate(cfg.model)
    shape = list(cfg.data.input_shape)
    assert net(torch.randn(4, *shape)).shape == (4, cfg.data.num_classes)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_is_partial_over_parameters(optimizer):
    cfg = compose_train(f"optimizer={optimizer}")
    params = list(instantiate(cfg.model).parameters())
    opt = optimizer_factory(cfg.optimizer)(params)
    expected_class, expected_lr = OPTIMIZERS[optimizer]
    assert type(opt) is expected_class
    assert opt.param_groups[0]["lr"] == expected_lr
    assert opt.param_groups[0]["params"] == params


def lrs_over(scheduler, optimizer, steps: int) -> list[float]:
    """The lr used by optimizer steps 0 .. steps (inclusive), as the loop sees them."""
    lrs = []
    for _ in range(steps + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_constant_schedule():
    cfg = compose_train("scheduler=constant")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=30, steps_per_epoch=10)
    assert lrs_over(scheduler, optimizer, 30) == [0.5] * 31


def test_cosine_schedule_warms_up_then_decays_to_min_lr_ratio():
    cfg = compose_train("scheduler=cosine", "scheduler.min_lr_ratio=0.1")
    assert cfg.scheduler.warmup_epochs is None and cfg.scheduler.warmup_steps is None  # neither: one epoch
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    # 5 epochs of 10 steps: warm-up over steps 0-9, cosine over steps 10-50.
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=50, steps_per_epoch=10)
    lrs = lrs_over(scheduler, optimizer, 50)
    assert lrs[0] == pytest.approx(0.1)  # 1/10 of the peak: the first step already moves
    assert lrs[4] == pytest.approx(0.5)
    assert lrs[9] == lrs[10] == pytest.approx(1.0)
    assert lrs[30] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lrs[50] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_default_composition():
    cfg = compose_train()
    assert cfg.parallel._target_ == "hydraloop.parallel.single.SingleDevice"
    assert cfg.data.dataset._target_ == "hydraloop.data.digits.load_digits"
    assert cfg.model._target_ == "hydraloop.models.mlp.MLP"
    assert cfg.optimizer._target_ == "torch.optim.AdamW"
    assert cfg.scheduler._target_ == "hydraloop.schedulers.constant"
    assert cfg.device == "auto" and cfg.ckpt_path is None and cfg.seed == 0
    assert type(cfg.trainer.max_epochs) is int and cfg.trainer.max_epochs == 20
    assert type(cfg.data.batch_size) is int and cfg.data.batch_size == 64


def test_batch_size_is_global():
    """With DDP the config keeps the global batch; each of the ranks loads its share of it."""
    cfg = compose_train("parallel=ddp")
    assert cfg.data.batch_size == 64
    dataset = TensorDataset(torch.arange(200))
    loaders = [make_loaders(dataset, cfg.data.batch_size, rank, 2)[0] for rank in (0, 1)]
    first = [next(iter(loader))[0] for loader in loaders]
    assert [len(batch) for batch in first] == [32, 32]


def make_loaders(dataset, batch_size: int, rank: int, world_size: int):
    return build_loaders(
        dataset,
        dataset,
        global_batch_size=batch_size,
        global_val_batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        seed=7,
        num_workers=0,
        drop_last=True,
        device=torch.device("cpu"),
    )


def global_batches(size: int, batch_size: int, world_size: int, epoch: int) -> list[list[int]]:
    """Global batch k: the sorted union of every rank's k-th batch (samples are their own indices)."""
    dataset = TensorDataset(torch.arange(size))
    per_rank = []
    for rank in range(world_size):
        loader = make_loaders(dataset, batch_size, rank, world_size)[0]
        loader.set_epoch(epoch)
        per_rank.append([batch[0].tolist() for batch in loader])
    assert len({len(batches) for batches in per_rank}) == 1, "ranks disagree on the number of steps"
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.parametrize(
    "size",
    [
        100,  # 100 % 8 == 4
        103,  # 103 % 8 == 7: a padded rank shard (52) would fill a 13th step of 4 that one process lacks
    ],
)
@pytest.mark.parametrize("epoch", [0, 1])
def test_ddp_global_batches_match_single_process(size, epoch):
    single = global_batches(size, 8, 1, epoch)
    ddp = global_batches(size, 8, 2, epoch)
    assert len(single) == size // 8
    assert len(ddp) == len(single)
    assert ddp == [sorted(batch) for batch in single]
    assert single != global_batches(size, 8, 1, epoch + 1)  # set_epoch reshuffles


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_shards_cover_every_sample_once(world_size):
    size = 101
    indices = [i for rank in range(world_size) for i in ShardSampler(size, rank, world_size)]
    assert sorted(indices) == list(range(size))
    # Through the real loaders too, with a val batch that does not divide the shards.
    dataset = TensorDataset(torch.arange(size))
    seen = [
        i
        for rank in range(world_size)
        for batch in make_loaders(dataset, 6, rank, world_size)[1]
        for i in batch[0].tolist()
    ]
    assert sorted(seen) == list(range(size))


def test_epoch_seed_differs_across_ranks_and_epochs_and_is_deterministic():
    seeds = {(rank, epoch): epoch_seed(0, rank, epoch) for rank in range(4) for epoch in range(5)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= seed < 2**32 for seed in seeds.values())
    assert seeds == {(rank, epoch): epoch_seed(0, rank, epoch) for rank in range(4) for epoch in range(5)}
    assert epoch_seed(1, 0, 0) != epoch_seed(0, 0, 0)
