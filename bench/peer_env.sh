#!/usr/bin/env bash
# Build `.peer-venv`: speculators 0.9.0 (the peer of bench/bench_train_step.py) next to the SAME CPU
# torch as the project. speculators pins torchvision/torchaudio and transformers<=5.19 in its metadata;
# installing it normally would replace torch, so it goes in with --no-deps and we add only what its
# PEagle modules import. Usage: bash bench/peer_env.sh  (idempotent; ~2 minutes the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.peer-venv
PY=${PYTHON:-python3.11}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0
# What speculators' package import + models.peagle need (no torchvision/torchaudio, no datasets extras).
"$PIP" install -q transformers==5.23.0 safetensors pydantic pydantic-settings "loguru<=0.7.3" \
  "numpy<=2.5.4" "tqdm<=4.70.1" psutil rich typer click httpx protobuf huggingface-hub openai "datasets<=5.1.0" aiohttp
"$PIP" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
# torch must still be the local CPU 2.13.0 wheel.
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
from speculators.models.peagle import PEagleDraftModel  # noqa: F401
print("peer venv ok: torch", torch.__version__)
PY
