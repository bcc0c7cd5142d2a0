"""`peagle train tiny` end to end in a subprocess: exit 0, the RUN layout of the contract, a valid export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from peagle.cli import app

PHASES = ["validating", "preparing_data", "building_vocab", "capturing", "training", "evaluating", "exporting", "done"]


def _peagle(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP spin-waits on a shared CPU
    return subprocess.run([sys.executable, "-m", "peagle", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_target_path) -> tuple[Path, subprocess.CompletedProcess]:
    run = tmp_path_factory.mktemp("cli") / "run"
    proc = _peagle("train", "tiny", "--out", str(run), "--progress-jsonl", "-")
    return run, proc


def test_train_exits_zero_and_streams_json_lines(tiny_run):
    run, proc = tiny_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]  # every stdout line is a JSON record
    assert all({"type", "time"} <= set(r) for r in records)
    phases = [r["phase"] for r in records if r.get("kind") == "phase"]
    assert phases == PHASES
    assert any(r["type"] == "metric" and "loss" in r["values"] for r in records)
    evals = [r for r in records if r.get("kind") == "eval" and "acceptance_length" in r["metrics"]]
    assert evals and len(evals[-1]["metrics"]["per_position"]) == 3
    ckpts = [r for r in records if r.get("kind") == "checkpoint"]
    assert ckpts and all(any(f["path"] == "model.safetensors" for f in c["files"]) for c in ckpts)
    file_records = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    assert [r["type"] for r in file_records] == [r["type"] for r in records]


def test_run_directory_layout(tiny_run):
    run, _ = tiny_run
    from peagle.spec import parse_spec

    resolved = parse_spec(json.loads((run / "resolved_spec.json").read_text()))
    assert resolved.draft.aux_layer_ids == [1, 2, 3]  # tiny-llama: 4 layers, [2, N//2, N-3] collide -> [1, 2, 3]
    assert isinstance(resolved.draft.mask_token_id, int) and resolved.draft.draft_vocab_size == 512
    assert resolved.optim.max_steps >= 1 and resolved.eval.num_speculative_tokens == 3
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["packages"]["torch"] and prov["resolved"]["total_steps"] == resolved.optim.max_steps
    assert (run / "data" / "vocab.safetensors").is_file()
    state = json.loads((run / "checkpoints" / "state.json").read_text())
    for name in (state["latest"], state["best"]):
        ck = run / "checkpoints" / name
        for f in ("config.json", "model.safetensors", "training_state.pt", "meta.json", "COMPLETE"):
            assert (ck / f).is_file(), ck / f
    for f in ("config.json", "model.safetensors", "eval.json"):
        assert (run / "export" / f).is_file()
    ev = json.loads((run / "export" / "eval.json").read_text())
    assert ev["checkpoint"] == state["best"] and ev["acceptance_length"] >= 1.0


def test_export_names_a_portable_verifier(tiny_run):
    run, _ = tiny_run
    for d in (run / "export", *sorted((run / "checkpoints").glob("step_*"))):
        text = (d / "config.json").read_text()
        verifier = json.loads(text)["speculators_config"]["verifier"]["name_or_path"]
        assert verifier == "builtin:tiny-llama", d  # no hub original: the name any peagle install rebuilds
        assert '"/' not in text and str(Path.home()) not in text, d  # no path of the training host


def _cli(*args: str):
    """In-process CLI call (the subprocess contract is covered by the train run above)."""
    return CliRunner().invoke(app, list(args))


def test_validate_passes_on_run_and_export(tiny_run):
    """The tiny export is valid; where vLLM runs on the CPU (head_dim 16 is refused there) `peagle validate`
    says it cannot run here (issue 39: it passed, then `peagle eval --engine vllm` failed minutes later)."""
    from peagle.engine.locate import vllm_python
    from peagle.engine.machine import vllm_runs_on_cpu

    run, _ = tiny_run
    python = vllm_python()
    cpu_vllm = python is not None and vllm_runs_on_cpu(python)
    for d in (run, run / "export"):
        r = _cli("validate", str(d), "--portable")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith("ok:")
        r = _cli("validate", str(d))
        if cpu_vllm:
            assert r.exit_code == 8, r.stdout
            assert "cannot run in this machine's vLLM" in r.stderr and "head_dim 16" in r.stderr, r.stderr
            doc = json.loads(_cli("validate", str(d), "--json").stdout)
            assert doc["ok"] is False and doc["violations"] == [] and "head_dim 16" in doc["not_here"][0]
        else:
            assert r.exit_code == 0, r.stderr
            assert r.stdout.startswith("ok:")


def test_eval_with_vllm_refuses_at_once_what_this_machine_cannot_run(tiny_run):
    """Issue 39: `peagle eval --engine vllm` on the tiny export failed after minutes with vLLM's trace."""
    import time

    from peagle.engine.locate import vllm_python
    from peagle.engine.machine import vllm_runs_on_cpu

    python = vllm_python()
    if python is None or not vllm_runs_on_cpu(python):
        pytest.skip("this machine's vLLM runs on a GPU (or there is none)")
    run, _ = tiny_run
    t0 = time.monotonic()
    r = _cli("eval", str(run), "--engine", "vllm", "--num-prompts", "1")
    assert r.exit_code == 9, r.stderr
    assert "cannot run in this machine's vLLM" in r.stderr and "head_dim 16" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_export_eagle3_layout_and_eval(tiny_run, tmp_path):
    run, _ = tiny_run
    r = _cli("export", str(run), "--out", str(tmp_path / "e3"), "--layout", "eagle3")
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = _cli("eval", str(run / "export"), "--prompts", "humaneval", "--num-prompts", "1", "--max-new-tokens", "6",
                 "--json")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["engine"] == "reference" and rep["tokens_generated"] == 6 and len(rep["per_position"]) == 3
    assert "per_request_spread" in rep and "outputs" not in rep


def test_eval_reports_every_prompt_set_and_refuses_speedup_without_vllm(tiny_run):
    """Issue 18: AL per prompt set (the held-out ShareGPT prompts, HumanEval, a JSONL file); --speedup times
    vLLM serving, so the reference engine alone is refused with one line."""
    run, _ = tiny_run
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = _cli("eval", str(run / "export"), "--prompts", "humaneval", "--prompts", "sharegpt-heldout",
                 "--num-prompts", "1", "--max-new-tokens", "4", "--json")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep["prompt_sets"]) == {"humaneval", "sharegpt-heldout"} and rep["prompts"] == "humaneval"
    assert rep["acceptance_length"] == rep["prompt_sets"]["humaneval"]["acceptance_length"]
    r = _cli("eval", str(run / "export"), "--speedup")
    assert r.exit_code != 0 and "--engine vllm" in r.stderr and "Traceback" not in r.stderr


def test_offline_capture_caches_the_held_out_rows_too(tmp_path, tiny_target_path):
    """capture=offline: train AND held-out features are captured once to RUN/data/features/{train,eval}."""
    from peagle.spec import preset

    spec = preset("tiny").model_dump(mode="json")
    spec["resources"]["capture"] = "offline"
    spec["optim"]["max_steps"], spec["checkpoints"]["every_steps"] = 4, 2  # two held-out evals read the cache
    spec["eval"]["prompt_sets"] = []
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    run = tmp_path / "run"
    proc = _peagle("train", str(path), "--out", str(run), "--progress-jsonl", "-")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("train", "eval"):
        manifest = json.loads((run / "data" / "features" / name / "manifest.json").read_text())
        assert manifest["complete"] and manifest["num_rows"] >= 1
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    evals = [r for r in records if r.get("kind") == "eval" and "eval_tau_sim" in r.get("metrics", {})]
    assert len(evals) == 2
