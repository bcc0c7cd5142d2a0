"""`peagle eval --engine vllm --speedup --sweep` says what it measures while it runs (issue 39: 21 silent
minutes): every K, round and batch size of the sweep as the probe starts it (slow: real vLLM, 1 + 2 x 2
engine starts)."""

from __future__ import annotations

import pytest

from tests.cli.conftest import smollm2_and_draft
from tests.cli.test_cli_progress import Peagle

pytestmark = pytest.mark.slow

SMOL_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_sweep_shows_each_k_and_batch_size_as_it_runs(smollm2_path, tmp_path) -> None:
    from peagle.export.writer import export_draft

    _target, draft = smollm2_and_draft(smollm2_path, copy_layers=False)
    export = export_draft(draft, tmp_path / "export", num_speculative_tokens=2, verifier_name_or_path=SMOL_HUB,
                          verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    p = Peagle("eval", str(export), "--engine", "vllm", "--speedup", "--sweep", "--num-prompts", "2",
               "--max-new-tokens", "8", "--rounds", "1", "--prompts", "humaneval")
    rc, out, ended = p.finish(timeout=1800)
    assert rc == 0, p.stderr()[-30:]
    assert p.lines[0][1].startswith("peagle eval") and p.lines[0][0] < 30
    p.wait_for("vLLM: AL on humaneval at K=2, serving speedup at K=1..2 (one engine start each), batch sizes "
               "[1, 2], 1 rounds: starting the engines", timeout=0)
    seen = []
    for k, i in ((1, 1), (2, 2)):
        for b in (1, 2):
            seen.append(p.wait_for(f"vLLM probe: speedup K={k} ({i}/2), round 1/1, batch size {b}", timeout=0))
    assert seen == sorted(seen) and seen[0] < ended - 1  # in order, as they happened, not at the end
    assert "serving speedup in vLLM" in out
