#!/usr/bin/env bash
# One device call of a session (docs/contributing.md): install the carried wheels (.whl/), then
#   1: the GPU tests, then bench/hf.py at batch 1 (reduce-overhead, xform)
#   2: bench/hf.py at batch 8 (reduce-overhead, xform, xform-float8)
#   3: bench/hf_train.py (a training step of a Llama and a sliding-window Mistral, seq 4096)
#   4: bench/hf.py at batch 1 and 8 (reduce-overhead, xform-float8-dynamic, torchao's float8-dynamic by hand)
#   5: the short of 3 and 4 in one call: bf16 against xform's set per training model, then batch 1
#   6: bench/hf_train.py, the sliding-window pair then the Llama pair (what fits in a short call)
#   s: bench/hf.py --model sliding at batch 1 (reduce-overhead, xform): the sliding-window cache's decode
#   h: tests/test_hf_attention_gpu.py (flex-attention on Hugging Face families), measured SQNRs in its junit XML
#   t: the GPU tests alone
# Everything it writes goes under $OUT. Usage on the device: bash bench/device_session.sh 1|2|3|4|5|6|s|h|t
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
  3) timeout 560 python3 bench/hf_train.py --out "$OUT" 2>&1 | tee "$OUT/train.log" ;;
  4) timeout 560 python3 bench/hf.py --only reduce-overhead,xform-float8-dynamic,torchao-float8-dynamic-ro --batches 1,8 \
       --repeats 3 --out "$OUT" 2>&1 \
       | tee "$OUT/hf4.log" ;;
  5) timeout 250 python3 bench/hf_train.py --repeats 5 --out "$OUT" \
       --only llama:inductor,llama:xform-float8-rowwise,sliding:inductor,sliding:xform-flex 2>&1 | tee "$OUT/train.log"
     timeout 140 python3 bench/hf.py --only reduce-overhead,xform-float8-dynamic --batches 1 --repeats 3 --out "$OUT" 2>&1 \
       | tee "$OUT/hf5.log" ;;
  6) timeout 225 python3 bench/hf_train.py --repeats 5 --out "$OUT" \
       --only sliding:inductor,sliding:xform-flex,llama:inductor,llama:xform-float8-rowwise 2>&1 | tee "$OUT/train.log" ;;
  s) timeout 400 python3 bench/hf.py --model sliding --only reduce-overhead,xform --batches 1 --repeats 3 --out "$OUT" 2>&1 \
       | tee "$OUT/hf_sliding.log" ;;
  h) timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hf_attention_gpu.py \
       --junitxml "$OUT/hf_attention_gpu.xml" 2>&1 | tail -40 | tee "$OUT/hf_attention_gpu.log" ;;
  t) gpu_tests 280 ;;
  *) echo "usage: bash bench/device_session.sh 1|2|3|4|5|6|s|h|t" >&2; exit 2 ;;
esac
