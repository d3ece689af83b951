#!/usr/bin/env bash
# The prepared GPU check (issue: speed, item 8): one command for a machine lent for a few minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default outputs/gpu_check; about 5 minutes on one GPU
#   DEVICE=cpu EPOCHS=1 bash scripts/gpu_check.sh  # a dry run of the script itself on a CPU machine
#
# Runs the CUDA-only tests, the benchmark in fp32 and bf16, and whole training runs of the MNIST-1D CNN for
# parallel=single, dataparallel, ddp (one GPU, nccl) and fsdp, each in fp32 and bf16 with compile off and on.
# Everything it prints goes to OUT_DIR/gpu_check.log, next to the benchmark's JSON and one folder per run.
set -uo pipefail # no -e: a failing part must not hide the figures of the others
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu_check}
device=${DEVICE:-cuda}
epochs=${EPOCHS:-3}
mkdir -p "$out/runs"
exec > >(tee "$out/gpu_check.log") 2>&1

echo "== machine ($(date -u +%FT%TZ))"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
[ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

echo "== CUDA-only tests (skipped without CUDA)"
python -m pytest -q -p no:cacheprovider tests/test_speed_features.py -k cuda

echo "== benchmark, fp32 (loop, start-up, ddp) and bf16 (loop)"
python scripts/benchmark.py --device "$device" --precision 32 --out "$out/benchmark_fp32.json"
python scripts/benchmark.py --device "$device" --precision bf16 --skip startup ddp --out "$out/benchmark_bf16.json"

echo "== whole runs: MNIST-1D CNN, $epochs epochs; samples/s is the median of the last epoch's logging intervals"
printf '%-13s %-5s %-8s %10s %9s %8s %7s\n' strategy prec compile samples/s wall_s val/acc exit
for strategy in single dataparallel ddp fsdp; do
    for precision in 32 bf16; do
        for compile in false true; do
            name=$strategy-$precision-compile_$compile
            python src/train.py "parallel=$strategy" "device=$device" "trainer.precision=$precision" \
                "trainer.compile=$compile" data=mnist1d model=cnn "trainer.max_epochs=$epochs" logger=none \
                trainer.save_checkpoints=false "hydra.run.dir=$out/runs/$name" >"$out/runs/$name.log" 2>&1
            status=$?
            python - "$out/runs/$name" "$strategy" "$precision" "$compile" "$epochs" "$status" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

run, strategy, precision, compile_, epochs, status = sys.argv[1:]
metrics_file = Path(run) / "metrics.json"
if not metrics_file.exists():
    print(f"{strategy:<13} {precision:<5} {compile_:<8} {'-':>10} {'-':>9} {'-':>8} {status:>7}")
    sys.exit()
metrics = json.loads(metrics_file.read_text())
last_epoch = [
    float(m.group(1))
    for line in (Path(run) / "train.log").read_text().splitlines()
    if f"epoch {epochs} step" in line and (m := re.search(r"\| ([\d.]+) samples/s", line))
]
rate = statistics.median(last_epoch) if last_epoch else float("nan")
print(
    f"{strategy:<13} {precision:<5} {compile_:<8} {rate:>10.0f} {metrics['wall_time_s']:>9.2f}"
    f" {metrics['val/acc']:>8.4f} {status:>7}"
)
EOF
        done
    done
done
echo "== done: $out"
