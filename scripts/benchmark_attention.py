"""Attention dropout at a long sequence: a transformers GPT-2 with attention dropout, trained with hydraloop's keyed
dropout (model=hf's default) against the same model as transformers ships it (torch's dropout, inside the fused
attention kernel where the device has one), one training step at a time.

    python scripts/benchmark_attention.py [--length 2048] [--batch 4] [--layers 2] [--width 256] [--heads 4]
                                          [--repeats 5] [--device auto] [--out outputs/benchmark_attention.json]

Per model: the median milliseconds of a forward and backward pass; the peak memory of one (CUDA's
max_memory_allocated above the model's own; on the CPU, none); the largest tensor saved for the backward pass; and
whether one of (batch, heads, T, T), a layer's attention weights or their mask, is saved: keyed dropout computes
attention a block of queries at a time (hydraloop.keyed_attention) and must save none. scripts/gpu_check.py runs it
at 2048 tokens; on the CPU, torch has no fused kernel with dropout and stores the weights itself.
"""

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hydraloop.models.hf import hf_model  # noqa: E402
from hydraloop.row_keys import RowKeys  # noqa: E402

VOCAB = 512


def measure(args, device: torch.device, keyed: bool) -> dict:
    config = {
        "n_layer": args.layers,
        "n_embd": args.width,
        "n_head": args.heads,
        "n_positions": args.length,
        "attn_pdrop": 0.1,
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
    }
    torch.manual_seed(0)
    model = hf_model(model_type="gpt2", config=config, vocab_size=VOCAB, keyed_dropout=keyed).to(device).train()
    ids = torch.randint(0, VOCAB, (args.batch, args.length), device=device)
    keys = RowKeys(seed=0, rank=0, world_size=1, device=device)
    shapes: list[tuple[int, ...]] = []

    def step(number: int, record: bool = False) -> None:
        def saved(tensor: torch.Tensor) -> torch.Tensor:
            shapes.append(tuple(tensor.shape))
            return tensor

        hooks = torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor) if record else nullcontext()
        with keys(number, 0, args.batch), hooks:
            loss = model(ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step(0, record=True)  # warm-up, and the saved tensors' sizes
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    times = []
    for number in range(1, args.repeats + 1):
        start = time.perf_counter()
        step(number)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    weights = (args.batch, args.heads, args.length, args.length)
    return {
        "dropout": "keyed (hydraloop)" if keyed else "torch's (transformers as shipped)",
        "ms_per_step": 1000 * statistics.median(times),
        "peak_mib_above_model": (torch.cuda.max_memory_allocated(device) - resident) / 2**20 if cuda else None,
        "largest_saved_elements": max(math.prod(shape) for shape in shapes),
        "attention_weights_elements": math.prod(weights),
        # A layer's weights, or their mask, by shape: not transformers' additive mask, (batch, 1, T, T).
        "saves_attention_weights": weights in shapes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark_attention.json")
    args = parser.parse_args()
    for flag, value, least in (("--length", args.length, 1), ("--batch", args.batch, 1), ("--layers", args.layers, 1)):
        if value < least:
            parser.error(f"{flag} {value}: must be at least {least}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    if args.heads < 2 or args.width % args.heads:
        # One head's weights, (batch, 1, T, T), would not be told apart from the mask.
        parser.error(f"--heads {args.heads} with --width {args.width}: at least 2 heads, dividing the width")
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    rows = [measure(args, device, keyed) for keyed in (True, False)]
    report = {"device": name, "length": args.length, "batch": args.batch, "heads": args.heads, "rows": rows}
    report["keyed_over_torch_time"] = rows[0]["ms_per_step"] / rows[1]["ms_per_step"]
    print(f"GPT-2 with attention dropout 0.1, {args.batch} x {args.length} tokens, on {name}")
    weights = rows[0]["attention_weights_elements"]
    print(f"{'dropout':<36}{'ms/step':>9}{'peak MiB':>10}{'largest saved':>15}  (a layer's weights: {weights})")
    for row in rows:
        peak = "-" if row["peak_mib_above_model"] is None else f"{row['peak_mib_above_model']:.0f}"
        print(f"{row['dropout']:<36}{row['ms_per_step']:>9.1f}{peak:>10}{row['largest_saved_elements']:>15}")
    print(f"keyed over torch's, time per step: {report['keyed_over_torch_time']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
