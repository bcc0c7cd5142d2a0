"""Issue 38 item 6: `vllm serve` takes the recommended `--speculative-config` with its K schedule
(`num_speculative_tokens_per_batch_size`, built by `peagle.eval.speedup` from a measured table) on an exported
P-EAGLE draft, serves requests at batch 1 and at a larger batch, and drafts by the schedule: at batch 1, where
the table gains, and not at batch 4, where it was a slowdown (K 0). Slow: one real engine start (SmolLM2 +
a 1-layer draft, fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from peagle.engine.server import EngineConfig, VllmServer
from peagle.eval.speedup import recommend, speculative_config
from tests.cli.conftest import smollm2_and_draft

pytestmark = pytest.mark.slow
K, MAX_NEW = 3, 16
PROMPTS = ["def add(a, b):", "The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


def _drafts(server: VllmServer, client: Any) -> float:
    """vLLM's `spec_decode_num_drafts` counter (draft steps verified so far), summed over its labels."""
    text = client.get(f"{server.base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_drafts_total"))  # fmt: skip


def _complete(server: VllmServer, client: Any, prompt: str | list[str]) -> list[dict[str, Any]]:
    """One completions request (a list of prompts: that many requests in the engine at once), greedy,
    exactly MAX_NEW tokens each."""
    r = client.post(f"{server.base_url}/v1/completions", json={
        "model": server.served_name, "prompt": prompt, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW,
        "ignore_eos": True, "temperature": 0.0})  # fmt: skip
    assert r.status_code == 200, server.failure(f"answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    assert body["usage"]["completion_tokens"] == MAX_NEW * (len(prompt) if isinstance(prompt, list) else 1)
    return list(body["choices"])


def test_vllm_serves_the_recommended_k_schedule(smollm2_path: Path, tmp_path: Path) -> None:
    import httpx

    from peagle.export.writer import export_draft

    _, draft = smollm2_and_draft(smollm2_path, copy_layers=False)  # skips without the vLLM venv
    export = export_draft(draft, tmp_path / "export", num_speculative_tokens=K,
                          verifier_name_or_path=str(smollm2_path), verifier_architectures=["LlamaForCausalLM"])
    # measured: K=3 gains at batch 1 in every round, and is a slowdown at batch 4
    table = [{"num_speculative_tokens": K, "batch_size": 1, "speedup": 1.2, "speedup_per_round": [1.2, 1.1, 1.3]},
             {"num_speculative_tokens": K, "batch_size": 4, "speedup": 0.8, "speedup_per_round": [0.8, 0.7, 0.9]}]
    cfg = speculative_config(str(export), recommend(table), K)
    assert cfg is not None and cfg["num_speculative_tokens_per_batch_size"] == [[1, 3, K], [4, 4, 0]]
    engine = EngineConfig(model=str(smollm2_path), dtype="float32", max_model_len=256, extra_args=(
        "--speculative-config", json.dumps(cfg), "--no-enable-prefix-caching", "--max-num-seqs", "8"))
    log = tmp_path / "engine.log"
    with VllmServer(engine, log_path=log, name="K-schedule engine") as server, httpx.Client(timeout=600) as client:
        assert _drafts(server, client) == 0
        _complete(server, client, "Write a haiku about the sea.")  # batch 1: K=3
        at_1 = _drafts(server, client)
        assert at_1 > 0, "no draft at batch 1, where the schedule says K=3"
        assert len(_complete(server, client, PROMPTS)) == len(PROMPTS)  # batch 4: K 0
        at_4 = _drafts(server, client) - at_1
        # drafting at batch 4 would verify at least len(PROMPTS) * MAX_NEW / (K + 1) = 16 drafts; K 0 leaves at
        # most one per request (a step it ran alone, before the others were scheduled)
        assert at_4 <= len(PROMPTS), f"{at_4} drafts at batch 4, where the schedule says K 0"
    text = log.read_text(errors="replace")
    assert "Disabling num_speculative_tokens_per_batch_size" not in text  # vLLM's fallback to a static K
