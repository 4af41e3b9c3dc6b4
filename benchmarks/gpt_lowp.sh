#!/usr/bin/env bash
# The GPT table of issue 19: bf16-mixed and the FP8/FP4 recipes on the fortunes corpus for a fixed budget of 300
# steps (the README's GPT settings), 2 repeats each, each a fresh process; the loss gap of each recipe to bf16 is
# its "Δ test loss vs fp32"-style column read against the bf16-mixed row. CPU-heavy (the MX/NVFP4 GEMMs are
# emulated): run it on a quiet machine.
#
# Usage: bash benchmarks/gpt_lowp.sh [OUT_DIR]   (default runs/gpt-lowp); EXTRA="--fp8-impl torchao" passes flags on
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpt-lowp}"
PY="${PYTHON:-python}"
# shellcheck disable=SC2086
"$PY" -m mixprec bench --model gpt --dataset text --n-layers 2 --n-heads 4 --d-model 128 --block-size 64 \
  --batch-size 32 --optimizer adamw --lr 1e-3 --max-steps 300 --limit-test 512 \
  --precisions bf16-mixed,fp8-mixed,fp8-rowwise,mxfp8,nvfp4 --repeats 2 --out "$OUT" ${EXTRA:-}
echo "gpt_lowp.sh: the table is in $OUT/results.md"
