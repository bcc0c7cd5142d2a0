"""The dry-run estimate's CPU-class factors (`service.estimate.calibration` TARGET_SPEED, DRAFT_SPEED), measured here.

    .venv/bin/python -m bench.cpu_class_speed        # about 5 minutes; writes bench/results/cpu_class_speed.json

Not part of `make bench` (it measures constants, it compares nothing). Each measurement runs in a fresh
process, one after the other:

* draft: fp32 draft training steps (`bench_train_step`'s setting: SmolLM2 dimensions, 2 layers, T = 512,
  K = 8; ours only) natively and with AVX2 emulated for torch, oneDNN and MKL (`ATEN_CPU_CAPABILITY=avx2
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`);
* target: vLLM generation of SmolLM2-135M (`bench_regen`'s driver, vLLM only, 32 prompts in flight) in
  bfloat16 and float32 natively, and in float32 with `ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`.
  That emulation is partial: the engine's environment passes oneDNN's and MKL's variables but not
  `ATEN_CPU_CAPABILITY` (`peagle.engine.environment`), and vLLM's own CPU kernels (attention, norms) are
  compiled for the ISA the wheel was built for, whatever these variables say.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "cpu_class_speed.json"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

_DRAFT = """
import json, statistics, torch
from bench import bench_train_step as b
from peagle.builtin import smollm2_dir
from peagle.model.draft import DraftConfig
from peagle.data.packing import shift_rows
from transformers import AutoConfig, AutoTokenizer
torch.set_num_threads(2)
folder = smollm2_dir()
tok = AutoTokenizer.from_pretrained(folder); tcfg = AutoConfig.from_pretrained(folder)
ids, mask, _ = b.real_row(tok, b.T)
s_ids, s_mask, s_doc = shift_rows(ids, mask, torch.zeros_like(ids))
cfg = DraftConfig.from_target(tcfg, num_layers=b.LAYERS, draft_vocab_size=b.VD, mask_token_id=int(tcfg.vocab_size) - 1,
                              aux_layer_ids=[2, 15, 27])
g = torch.Generator().manual_seed(1)
batch = {"input_ids": s_ids, "loss_mask": s_mask, "document_ids": s_doc,
         "aux": torch.randn(1, b.T, 3 * cfg.hidden_size, generator=g), "target_logits": torch.randn(1, b.T, b.VD, generator=g)}
wall, cpu = b.run_ours(cfg, batch, 6, 2, freeze_lm_head=False)
print("RESULT", json.dumps({"step_s": statistics.median(wall), "isa": torch.backends.cpu.get_cpu_capability()}))
"""


def _result(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    found = re.findall(r"^RESULT (.*)$", out.stdout, flags=re.MULTILINE)
    if not found:
        raise SystemExit(f"{cmd[:3]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return dict(json.loads(found[-1]))


_TARGET = """
import json, sys
sys.argv = ["bench_regen", "--skip-hf", "--convs", "32", "--max-new-tokens", "96", "--batch", "32", "--dtype", DTYPE]
from bench import bench_regen
bench_regen.main()
rep = json.load(open("bench/results/regen.json"))
print("RESULT", json.dumps(rep["vllm"]))
"""


def main() -> int:
    py = sys.executable
    res: dict[str, Any] = {"load_average_start": [round(x, 2) for x in os.getloadavg()]}
    res["draft_native"] = _result([py, "-c", _DRAFT], {})
    res["draft_avx2"] = _result([py, "-c", _DRAFT], AVX2)
    for name, dtype, env in (("target_bf16", "bfloat16", {}), ("target_fp32", "float32", {}),
                             ("target_fp32_avx2", "float32", AVX2)):
        res[name] = _result([py, "-c", _TARGET.replace("DTYPE", repr(dtype))], env)
    res["draft_avx2_speed"] = round(res["draft_native"]["step_s"] / res["draft_avx2"]["step_s"], 3)
    bf16 = res["target_bf16"]["tokens_per_s"]
    res["target_fp32_speed"] = round(res["target_fp32"]["tokens_per_s"] / bf16, 3)
    res["target_fp32_avx2_speed"] = round(res["target_fp32_avx2"]["tokens_per_s"] / bf16, 3)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=1))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
