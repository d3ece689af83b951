"""Random numbers per sample that every strategy draws alike: keyed by what they act on, not drawn from a generator.

Noise a task or model draws per sample from torch's generators (a diffusion model's timesteps and noise, a VAE's
reparameterisation, masking, stochastic depth) depends on who draws it: each DDP rank draws for its own shard, each
micro-batch for itself, so the run trains other numbers than one process does. The functions here compute each number
as a hash of (seed, step, pass, the sample's row in the global batch, `key`, the element's coordinates), as
KeyedDropout's masks are (JAX's explicit keys are the model: the draw says what it depends on). A sample then gets
the same numbers in one process, on any of N ranks, in any micro-batch, in an activation checkpoint's recomputation,
and after a resume. In validation a sample's numbers depend on its index in the validation set, the same at every
validation. Outside the loop's forward passes (a model called by hand, mode=predict) they are torch's draws.

    from hydraloop import keyed_random as keyed

    def training_loss(self, model, batch):                      # a task's, DDPM-style
        x = batch[0]
        t = keyed.integers(0, self.steps, (len(x),), key="t")   # a timestep per sample
        noise = keyed.normal_like(x, key="noise")               # Gaussian noise per element
        ...

`key` tells a caller's draws apart: the same key at the same step gives the same numbers, so two draws of one step
need two keys (`key=("view", 0)`, `key=("view", 1)`); a key is any str, int or tuple (or list) of them. The first
dimension of the shape is the batch's rows, exactly: one pattern for the whole batch would be another one on each
rank, so any other first dimension is a ValueError (a batch of each row's k views is drawn (rows, k, ...), then
flattened). Numbers: uniform floats with as many random bits as the dtype's mantissa holds (24 in float32, 53 in
float64; never 1.0), normals by Box-Muller from one 64-bit hash, integers from 53 random bits.
"""

import hashlib
import math
from functools import lru_cache

import torch
from torch import Tensor

from hydraloop.row_keys import current_rows, element_keys, layer_key, mix_int

Key = str | int | tuple


def uniform(shape: tuple[int, ...], key: Key, *, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Uniform numbers in [0, 1) of `shape` (rows first), as torch.rand draws them."""
    bits = _bits(shape, key, device)
    if bits is None:
        return torch.rand(shape, dtype=dtype, device=device)
    return _uniform(bits, dtype)


def uniform_like(x: Tensor, key: Key) -> Tensor:
    return uniform(tuple(x.shape), key, dtype=x.dtype, device=x.device)


def normal(shape: tuple[int, ...], key: Key, *, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Standard normal numbers of `shape` (rows first), as torch.randn draws them."""
    bits = _bits(shape, key, device)
    if bits is None:
        return torch.randn(shape, dtype=dtype, device=device)
    precise = torch.float64 if dtype == torch.float64 else torch.float32
    # Box-Muller from the two halves of one 64-bit hash: the high one, offset by half a step, is never 0.
    high = (bits >> 32 & 0xFFFFFFFF).to(precise).add_(0.5).mul_(2.0**-32)
    low = (bits & 0xFFFFFFFF).to(precise).mul_(2.0**-32)
    return high.log_().mul_(-2.0).sqrt_().mul_(torch.cos(low.mul_(2 * math.pi))).to(dtype)


def normal_like(x: Tensor, key: Key) -> Tensor:
    return normal(tuple(x.shape), key, dtype=x.dtype, device=x.device)


def integers(low: int, high: int, shape: tuple[int, ...], key: Key, *, device=None) -> Tensor:
    """Integers in [low, high) of `shape` (rows first), int64, as torch.randint draws them."""
    bits = _bits(shape, key, device)
    if bits is None:
        return torch.randint(low, high, shape, device=device)
    return _uniform(bits, torch.float64).mul_(high - low).floor_().long().add_(low)


def bernoulli(p: float | Tensor, shape: tuple[int, ...], key: Key, *, device=None) -> Tensor:
    """True with probability `p` (a number, or a tensor that broadcasts to `shape`), a bool tensor of `shape`."""
    return uniform(shape, key, dtype=torch.float64 if isinstance(p, float) else torch.float32, device=device) < p


def permutation(rows: int, n: int, key: Key, *, device=None) -> Tensor:
    """A random permutation of range(n) per row: an int64 tensor (rows, n)."""
    return uniform((rows, n), key, dtype=torch.float64, device=device).argsort(dim=1)


def random_mask(rows: int, n: int, ratio: float, key: Key, *, device=None) -> Tensor:
    """Per row, exactly round(ratio * n) of n positions chosen at random (True), the rest False: a (rows, n) bool
    tensor, as MAE or BERT-style masking takes it."""
    order = permutation(rows, n, key, device=device)  # position order[i, j] is the row's j-th pick
    mask = torch.zeros(rows, n, dtype=torch.bool, device=order.device)
    return mask.scatter_(1, order[:, : round(ratio * n)], True)


def _bits(shape: tuple[int, ...], key: Key, device) -> Tensor | None:
    """A well-mixed int64 per element of `shape`, keyed by the loop's rows and step; None outside the loop's rows
    (then the caller draws from torch's generators)."""
    keys = current_rows()
    if keys is None:
        return None
    rows, step_key = keys
    shape = tuple(shape)
    if not shape or shape[0] != len(rows):
        raise ValueError(
            f"a keyed draw of shape {shape}: its first dimension must be the batch's {len(rows)} rows (a batch of k "
            "entries a row: draw (rows, k, ...), then flatten)"
        )
    if device is not None and torch.device(device) != rows.device:
        rows, step_key = rows.to(device), step_key.to(device)
    key = tuple(key) if isinstance(key, list) else key
    # A key per element: element_keys hashes every dimension but a last one, here one of size 1.
    return element_keys((*shape, 1), rows, layer_key(step_key, _key_term(key))).reshape(shape)


def _uniform(bits: Tensor, dtype: torch.dtype) -> Tensor:
    """Uniforms in [0, 1) with as many random bits as `dtype` holds exactly: more would round up to 1.0."""
    if dtype == torch.float64:
        return (bits >> 11 & (2**53 - 1)).to(torch.float64).mul_(2.0**-53)
    kept = 1 - round(math.log2(torch.finfo(dtype).eps))  # float32 24, float16 11, bfloat16 8
    return (bits >> (64 - kept) & (2**kept - 1)).to(torch.float32).mul_(2.0**-kept).to(dtype)


@lru_cache(maxsize=4096)
def _key_term(key: Key) -> int:
    """A key's 64-bit term: a stable hash (Python's hash() of a str differs per process), apart from every dropout
    layer's key."""
    digest = hashlib.blake2b(repr(("keyed_random", key)).encode(), digest_size=8).digest()
    return mix_int(int.from_bytes(digest, "little"))
