#!/usr/bin/env bash
# mixprec's GPU check, sized for one lent GPU slot: steps within --budget seconds (default 460; 8 minutes with the
# final report and a killed step's grace), every step under its own `timeout`, a step skipped when the time left is
# below what it needs; one log and one results folder.
#
# Steps, in order (a step's results under OUT/STEP/, its output in OUT/gpu_check.log):
#   tests              pytest -m cuda: the CUDA-only tests and the cuda half of every device test
#   train-fp32         python train.py --precision fp32 (the tutorial), one epoch
#   train-amp          python train.py --precision amp, one epoch
#   demo               `make demo`'s bench: fp32, amp, bf16-mixed on the CNN, batch 256, 2 epochs x 2 repeats
#   bench-transformer  mixprec bench, transformer d 512, 6 layers, patch 4, batch 512: fp32, bf16-mixed, fp8-mixed
#   bench-transformer-compile   the same with --compile: bf16-mixed, fp8-mixed
#   bench-mlp          mixprec bench, mlp width 4096, depth 4, batch 1024: fp32, bf16-mixed, fp8-mixed
#   bench-mlp-compile  the same with --compile: bf16-mixed, fp8-mixed
#   overhead           benchmarks/overhead.py: the plain PyTorch loop beside mixprec's step, same model and recipe
#   watch              benchmarks/watch_overhead.py: what mixprec.watch costs a plain loop (mlp above)
#   lowp               benchmarks/lowp_gpu_check.py: one layer's FP8/FP4 GEMMs against the CPU emulation
#   profile            benchmarks/profile_ops.py: torch.profiler's ten costliest ops per recipe, transformer above
#
# Usage: bash benchmarks/gpu_check.sh [--only STEP,...] [--budget S] [--data-dir DIR] [--torchao-wheel WHL]
#                                     [--out DIR] [--cpu-smoke] [--list]
#   --out        results folder (default $OUT if set, else runs/gpu_check)
#   --data-dir   Fashion-MNIST's four .gz files (default runs/fashion-mnist if it holds them, else mixprec's own
#                lookup); --torchao-wheel: installed with pip --no-index --no-deps --target ~/site when torchao
#                does not import (default: runs/wheels/torchao-*.whl if present). benchmarks/README.md, "GPU check",
#                says how to carry both to a GPU machine without network.
#   --only       rerun chosen steps (e.g. --only lowp,profile after a first try ran out of time)
#   --cpu-smoke  every step on the CPU at toy sizes: checks the command lines before a GPU slot is spent on them
# It calls python directly (no make: make would try pip and apt); PYTHON picks the interpreter. Without CUDA
# (and without --cpu-smoke) every step says "skipped: no CUDA" and the script exits 0. Exit 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(tests train-fp32 train-amp demo bench-transformer bench-transformer-compile bench-mlp bench-mlp-compile
       overhead watch lowp profile)
START=$SECONDS  # the budget counts from here: the wheel's install and the header included
ONLY="" BUDGET=460 SMOKE=0 DATA_DIR="${DATA_DIR:-}" WHEEL="${TORCHAO_WHEEL:-}" RESULTS="${OUT:-runs/gpu_check}"
die() { echo "gpu_check.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --only) [ $# -ge 2 ] || die "--only needs STEP,... (one of: ${STEPS[*]})"; ONLY=$2; shift 2 ;;
    --budget) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--budget needs whole seconds, e.g. --budget 480"; BUDGET=$2; shift 2 ;;
    --data-dir) [ $# -ge 2 ] || die "--data-dir needs a folder"; DATA_DIR=$2; shift 2 ;;
    --torchao-wheel) [ $# -ge 2 ] || die "--torchao-wheel needs a .whl file"; WHEEL=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; RESULTS=$2; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --list) printf '%s\n' "${STEPS[@]}"; exit 0 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
for s in ${ONLY//,/ }; do
  [[ " ${STEPS[*]} " == *" $s "* ]] || die "--only: no step '$s'; choose from: ${STEPS[*]}"
done

mkdir -p "$RESULTS" || die "cannot create the results folder $RESULTS; use --out DIR"
LOG="$RESULTS/gpu_check.log"
SUMMARY="$RESULTS/summary.md"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # absolute: bench's workers import it too

if [ -z "$DATA_DIR" ] && [ -f runs/fashion-mnist/train-images-idx3-ubyte.gz ]; then DATA_DIR=runs/fashion-mnist; fi
if [ -z "$WHEEL" ]; then WHEEL=$(ls runs/wheels/torchao-*.whl 2>/dev/null | head -n 1); fi
if [ -n "$WHEEL" ]; then
  export PYTHONPATH="$PYTHONPATH:$HOME/site"
  if ! "$PY" -c 'import torchao' 2>/dev/null; then
    echo "gpu_check.sh: installing $WHEEL into $HOME/site"
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$HOME/site" "$WHEEL" \
      || echo "gpu_check.sh: the torchao wheel did not install; the torchao rows will say why they did not run"
  fi
fi
DATA=()
if [ -n "$DATA_DIR" ]; then DATA=(--data-dir "$DATA_DIR"); fi

HAS_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$SMOKE" = 1 ]; then
  DEV=cpu
  MLP=(--model mlp --width 64 --depth 2 --batch-size 64)
  TR=(--model transformer --d-model 32 --n-heads 4 --n-layers 1 --patch-size 7 --batch-size 64)
  MLP_FLAGS=mlp:width=64,depth=2,batch_size=64
  TR_FLAGS=d_model=32,n_heads=4,n_layers=1,patch_size=7
  TR_BATCH=64
  # toy runs: 2048 samples (8 batches of the demo's 256), one repeat, no peak measurement to speak of
  SMALL=(--limit-train 2048 --limit-test 128 --repeats 1 --peak-seconds 0.05 --no-plots --no-plan)
  COMPILED=bf16-mixed  # the emulated FP8 layers do not compile on a CPU (aot_autograd: input mutations on views)
  TRAIN_SMALL=(--max-steps 20 --limit-test 500)
  TIMING=(--quick)
  LOWP=(--devices cpu,cpu --recipes fp8-mixed,mxfp8 --impls scratch)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
  DEV=cuda
  MLP=(--model mlp --width 4096 --depth 4 --batch-size 1024)
  TR=(--model transformer --d-model 512 --n-heads 8 --n-layers 6 --patch-size 4 --batch-size 512)
  MLP_FLAGS=mlp:width=4096,depth=4,batch_size=1024
  TR_FLAGS=d_model=512,n_heads=8,n_layers=6,patch_size=4
  TR_BATCH=512
  SMALL=()
  COMPILED=bf16-mixed,fp8-mixed
  TRAIN_SMALL=()
  TIMING=(--warmup 5 --steps 10 --rounds 7)
  LOWP=()
fi
BENCH=(--device "$DEV" --repeats 1 --epochs 1 --warmup-steps 5 --timeout 90 --peak-seconds 1 --no-plots)

{
  echo "# gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), budget ${BUDGET}s, results in $RESULTS"
  "$PY" - 2>/dev/null <<'EOF' || echo "# torch does not import with $PY: set PYTHON to an interpreter that has it"
import importlib.metadata, importlib.util, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
ao = "torchao " + importlib.metadata.version("torchao") if importlib.util.find_spec("torchao") else "no torchao"
print(f"# {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); {ao}; Python {platform.python_version()}")
EOF
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); data ${DATA_DIR:-the default lookup}"
} | tee "$SUMMARY"
printf '\n| step | result | seconds |\n|---|---|---|\n' >> "$SUMMARY"

FAILED=0
selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
record() { echo "| $1 | $2 | $3 |" >> "$SUMMARY"; }

# step NAME NEEDS CAP CMD...: run CMD under `timeout`, at most CAP seconds and never past the budget; skipped
# without CUDA, or when fewer than NEEDS seconds are left (about what the step takes on an H200: estimates).
step() {
  local name=$1 needs=$2 cap=$3; shift 3
  selected "$name" || return 0
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$DEV" = cuda ] && [ "$HAS_CUDA" != 1 ]; then
    echo "== $name: skipped: no CUDA"; record "$name" "skipped: no CUDA" 0; return 0
  fi
  if [ "$left" -lt "$needs" ]; then
    echo "== $name: skipped: ${left}s left of the budget, it needs about ${needs}s (rerun it: --only $name)"
    record "$name" "skipped: ${left}s left, needs ${needs}s" 0; return 0
  fi
  local limit=$((cap < left ? cap : left)) t0=$SECONDS rc
  echo "== $name (timeout ${limit}s): $*"
  timeout -k 10 "$limit" "$@"
  rc=$?
  local took=$((SECONDS - t0)) result=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then result="timed out after ${limit}s"; FAILED=1
  elif [ "$rc" != 0 ]; then result="failed (exit $rc)"; FAILED=1; fi
  echo "== $name: $result in ${took}s"
  record "$name" "$result" "$took"
}

step tests 40 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step train-fp32 20 90 "$PY" train.py --precision fp32 --device "$DEV" --epochs 1 "${DATA[@]}" "${TRAIN_SMALL[@]}"
step train-amp 20 90 "$PY" train.py --precision amp --device "$DEV" --epochs 1 "${DATA[@]}" "${TRAIN_SMALL[@]}"
step demo 80 180 "$PY" -m mixprec bench --precisions fp32,amp,bf16-mixed --model cnn --batch-size 256 --epochs 2 \
  --repeats 2 --device "$DEV" "${DATA[@]}" "${SMALL[@]}" --out "$RESULTS/demo"
step bench-transformer 60 150 "$PY" -m mixprec bench "${BENCH[@]}" "${TR[@]}" --limit-train 30000 \
  --precisions fp32,bf16-mixed,fp8-mixed "${DATA[@]}" "${SMALL[@]}" --out "$RESULTS/bench-transformer"
step bench-transformer-compile 80 200 "$PY" -m mixprec bench "${BENCH[@]}" "${TR[@]}" --limit-train 30000 --compile \
  --no-plan --precisions "$COMPILED" "${DATA[@]}" "${SMALL[@]}" --out "$RESULTS/bench-transformer-compile"
step bench-mlp 40 120 "$PY" -m mixprec bench "${BENCH[@]}" "${MLP[@]}" --precisions fp32,bf16-mixed,fp8-mixed \
  "${DATA[@]}" "${SMALL[@]}" --out "$RESULTS/bench-mlp"
step bench-mlp-compile 50 150 "$PY" -m mixprec bench "${BENCH[@]}" "${MLP[@]}" --compile --no-plan \
  --precisions "$COMPILED" "${DATA[@]}" "${SMALL[@]}" --out "$RESULTS/bench-mlp-compile"
step overhead 30 120 "$PY" benchmarks/overhead.py --device "$DEV" --models mlp,transformer \
  --recipes fp32,bf16-mixed,fp8-mixed --loops plain,mixprec --flags "$MLP_FLAGS" \
  --flags "transformer:$TR_FLAGS,batch_size=$TR_BATCH" "${TIMING[@]}" --json "$RESULTS/overhead.json"
step watch 30 120 "$PY" benchmarks/watch_overhead.py --device "$DEV" --models mlp --flags "$MLP_FLAGS" \
  --every 50 --rounds 5 --json "$RESULTS/watch_overhead.json" $([ "$SMOKE" = 1 ] && echo --quick)
step lowp 20 90 "$PY" benchmarks/lowp_gpu_check.py "${LOWP[@]}"
step profile 30 120 "$PY" benchmarks/profile_ops.py --device "$DEV" --model transformer --flags "$TR_FLAGS" \
  --batch-size "$TR_BATCH" --recipes fp32,bf16-mixed,fp16-mixed,fp8-mixed --out "$RESULTS/profile" \
  $([ "$SMOKE" = 1 ] && echo --steps 2 --warmup 1)

# the benches' tables, with the GPU's name and measured peaks, as a README section (cheap; not a timed step)
timeout 20 "$PY" - "$RESULTS" > "$RESULTS/README-section.md" 2>/dev/null <<'EOF'
import json, os, sys
from mixprec.bench.report import table
for name in ("demo", "bench-transformer", "bench-transformer-compile", "bench-mlp", "bench-mlp-compile"):
    path = os.path.join(sys.argv[1], name, "results.json")
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    print(f"#### {name}\n\n`{d['command']}`\n\n{table(d['summary'])}\n")
    peaks = d.get("peaks") or {}
    print("Measured matmul peaks: " + ", ".join(f"{k} {v['flops_per_s'] / 1e12:.1f} TFLOP/s" for k, v in peaks.items())
          + "\n")
EOF
[ -s "$RESULTS/README-section.md" ] || rm -f "$RESULTS/README-section.md"

echo
echo "gpu_check.sh: $((SECONDS - START))s of the ${BUDGET}s budget; log $LOG, summary $SUMMARY"
cat "$SUMMARY"
exec >&- 2>&-
wait "$TEE" 2>/dev/null
exit "$FAILED"
