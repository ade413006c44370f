#!/usr/bin/env bash
# grpo-bench on two CPU cores of a GPU machine's host, while the GPU tests and the CPU kernels' tests run on its
# other cores. This is how docs/log.md, "2026-11-29 — on the host CPU of an H200 machine" measured an AMX Xeon.
#
#   SHAPE_SRC=<dir with config.json + tokenizer files> OUT=<results dir> bash tools/device/host_cpu_bench.sh
#
# - The model: SHAPE_SRC's config with random weights (tools/device/shape_model.py), where the packaged GGUF is
#   too large to take along; under --fixed-length a step's work is set by the shapes alone.
# - Wheels in .whl/ (the project's packages the machine lacks: trl, transformers, datasets, hydra-core, ...) are
#   installed into /tmp/site first and put on PYTHONPATH.
# - The bench runs with CUDA hidden, pinned by taskset to one CPU on each of two physical cores, 2 threads; the
#   tests get the CPUs of every other core. BENCH_ARGS and BENCH_LIMIT (seconds) change the bench.
# - Results in $OUT: machine.txt (lscpu), bench.log, bench.tgz (bench.json, bench.md, every round's child),
#   tests_gpu.log, tests_cpu.log.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_cpu_bench}; mkdir -p "$OUT"; PY=${PY:-python3}
SHAPE_SRC=${SHAPE_SRC:?SHAPE_SRC=<directory with config.json and the tokenizer files> is needed}
BENCH_ARGS=${BENCH_ARGS:---steps 2 --warmup 1 --fixed-length --beta 0 --baseline fp32 --baseline trl-defaults --rounds 2 --profile}
BENCH_LIMIT=${BENCH_LIMIT:-520}
pin() { if command -v taskset >/dev/null; then taskset -c "$@"; else echo "no taskset: unpinned" >&2; shift; "$@"; fi; }
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
t0=$(date +%s)
{ lscpu; echo; lscpu -e; nproc; free -g; nvidia-smi -L; which g++ gcc; } > "$OUT/machine.txt" 2>&1
echo "model name: $(lscpu | grep 'Model name' | cut -c 34-); flags: $(lscpu | grep -o 'avx512_bf16\|amx_bf16\|avx512f\b\|avx2\b' | sort -u | tr '\n' ' ')"
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
$PY -c "import torch,transformers,trl;print('torch',torch.__version__,'transformers',transformers.__version__,'trl',trl.__version__,'capability',torch.backends.cpu.get_cpu_capability(),'avx512_bf16',torch.cpu._is_avx512_bf16_supported(),'amx',torch.cpu._is_amx_tile_supported(),'cuda',torch.cuda.is_available())"
$PY tools/device/shape_model.py "$SHAPE_SRC" /tmp/shape_model --stand-in > "$OUT/prep.log" 2>&1 || { tail -20 "$OUT/prep.log"; exit 1; }
tail -2 "$OUT/prep.log"
TINY=$(ls -d ~/.cache/grpo-exp/models/tiny_random-*seed0* | head -1)
# one CPU on each of two physical cores for the bench; the tests get the CPUs of every other core
read -r BENCH_CPUS TEST_CPUS < <($PY -c "
import subprocess
rows = [l.split(',') for l in subprocess.run(['lscpu', '-p=CPU,CORE'], capture_output=True, text=True).stdout.splitlines() if not l.startswith('#')]
first = {}
for cpu, core in rows: first.setdefault(core, cpu)
cores = list(first)[:2]
rest = [cpu for cpu, core in rows if core not in cores]
print(','.join(first[c] for c in cores), ','.join(rest) or ','.join(first[c] for c in cores))")
echo "bench on CPUs $BENCH_CPUS, tests on $TEST_CPUS ($(( $(date +%s) - t0 )) s in)"
( CUDA_VISIBLE_DEVICES= pin "$BENCH_CPUS" timeout "$BENCH_LIMIT" $PY -m grpo_exp.apps.bench --model /tmp/shape_model \
    $BENCH_ARGS --out /tmp/bench > "$OUT/bench.log" 2>&1
  echo "bench exit $? at $(( $(date +%s) - t0 )) s" >> "$OUT/bench.log" ) &
BENCH=$!
GRPO_EXP_GPU_TEST_MODEL=$TINY pin "$TEST_CPUS" timeout 240 $PY -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/training/test_cuda.py > "$OUT/tests_gpu.log" 2>&1
echo "gpu tests exit $? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|error" "$OUT/tests_gpu.log" | tail -3
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 pin "$TEST_CPUS" timeout 240 $PY -m pytest -q -rs -p no:cacheprovider \
  tests/core/test_small_rows.py tests/core/test_decode_softmax.py tests/core/test_small_rows_fp32.py \
  tests/core/test_logprob_head.py \
  tests/training/test_rollout.py::test_the_decoding_attention_kernel_samples_what_the_composed_attention_samples \
  > "$OUT/tests_cpu.log" 2>&1
echo "cpu tests exit $? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|error|SKIPPED" "$OUT/tests_cpu.log" | tail -8
wait $BENCH
tar czf "$OUT/bench.tgz" -C /tmp bench 2>/dev/null
tail -4 "$OUT/bench.log"
sed -n '/^| variant/,/^$/p' /tmp/bench/bench.md 2>/dev/null | head -30
echo "done at $(( $(date +%s) - t0 )) s"
