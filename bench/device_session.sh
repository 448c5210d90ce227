#!/usr/bin/env bash
# One device call of a session (docs/contributing.md): install the carried wheels (.whl/), then
#   1: the GPU tests, then bench/hf.py at batch 1 (reduce-overhead, xform)
#   2: bench/hf.py at batch 8 (reduce-overhead, xform, xform-float8)
#   t: the GPU tests alone
# Everything it writes goes under $OUT. Usage on the device: bash bench/device_session.sh 1|2|t
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, torchao, transformers; print(torch.__version__, torchao.__version__, transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
gpu_tests() {
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cudagraphs_gpu.py tests/test_quantize_gpu.py \
    tests/test_attention_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -30 "$OUT/gpu_tests.log"
}
case "$1" in
  1) gpu_tests 230
     timeout 300 python3 bench/hf.py --only reduce-overhead,xform --batches 1 --repeats 3 --out "$OUT" 2>&1 | tee "$OUT/hf1.log" ;;
  2) timeout 560 python3 bench/hf.py --only reduce-overhead,xform,xform-float8 --batches 8 --repeats 3 --out "$OUT/b8" 2>&1 \
       | tee "$OUT/hf2.log" ;;
  t) gpu_tests 280 ;;
  *) echo "usage: bash bench/device_session.sh 1|2|t" >&2; exit 2 ;;
esac
