#!/usr/bin/env bash
# Issue 11's GPU run as one device call (at most 9 minutes plus installing): the decode tables in bf16 (SmolLM2-135M's
# architecture, then the toys), peak GPU memory at k = 8, and the 0.9 M toy with CUDA graphs. Each part has its own
# time limit and streams its output into $OUT/<part>.log (5 files with versions.txt; a call returns at most 8), so a
# part that runs out still leaves the rows it printed.
#
# The device machine has PyTorch, lightning, torchmetrics and peft but transformers 5.17 (we pin 5.24), no registry,
# and the 98 MB SmolLM2 GGUF is over its 64 MiB upload: so `smollm2-arch` (that architecture, random weights: the
# same shapes and cost) stands in for `smollm2`, and the wheels travel:
#
#   here:   make gpu-wheels                        (transformers, peft, regex for Python 3.12 -> .whl/)
#   device: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# A dry run on this CPU: DEVICE=cpu PYTHON=.venv/bin/python EXTRA="--models llama-1M --new-tokens 4 --reps 1" \
#   bash benchmarks/gpu_check.sh   (EXTRA is appended to every part; a repeated option's last value wins)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
read -r -a EXTRA <<< "${EXTRA:-}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null
  "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| peft', peft.__version__)"
} 2>&1 | tee "$OUT/versions.txt"

part() {  # part NAME SECONDS ARGS...: one decode.py run, its output (table and setup line) in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): decode.py --device $DEVICE $* ${EXTRA[*]}"
  timeout "$limit" "$PY" benchmarks/decode.py --device "$DEVICE" "$@" "${EXTRA[@]}" 2>&1 | tee "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} (124: out of time)"
}

# The real model's shapes first: its rows carry the targets. Then the toys at batch 1 (the 1.15x clause).
part RESULTS_decode_cuda_smollm2 220 --models smollm2-arch --batches 1 8 --experts 2 4 8 --separate-k 2 \
  --new-tokens 32 --reps 3
part RESULTS_decode_cuda_toys 100 --models llama-1M llama-10M --batches 1 --experts 2 4 8 --separate-k 2 \
  --new-tokens 32 --reps 3
part RESULTS_decode_cuda_memory 80 --models smollm2-arch --batches 1 8 --experts 8 --memory-only
# Each compiled runner compiles in its warm-up (about 18 s a graph on this CPU): five graphs here.
part RESULTS_decode_cuda_graphs 150 --models llama-1M --batches 1 --experts 2 8 --separate-k \
  --new-tokens 32 --reps 3 --compile reduce-overhead
