"""The engine never outlives what started it, and its failures say what and why (slow: real vLLM)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.engine.server import EngineConfig, VllmServer
from peagle.errors import EngineError
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

#: How long an engine may take to answer `/health` (what `VllmServer.start` itself waits, its default): the
#: tests wait for readiness or an exit, never a shorter guess (under heavy load 300 s was not enough, issue 39).
ENGINE_READY_S = float(inspect.signature(VllmServer).parameters["startup_timeout_s"].default)
#: The overall bound of a wait on something the engine or the guard reports itself (readiness, an exit): the
#: engine's own limit plus a margin, so a slow machine is never failed by the test before the engine decides.
BOUND_S = ENGINE_READY_S + 120.0
#: How long processes that need no engine (the guard, plain Pythons) may take to appear or go under load.
PROCESS_S = 180.0


STARTER = """
import json, sys, time
from pathlib import Path
from peagle.engine.server import EngineConfig, VllmServer
cfg = EngineConfig(model=sys.argv[1], dtype="bfloat16", max_model_len=256)
server = VllmServer(cfg, log_path=Path(sys.argv[2]) / "engine.log", startup_timeout_s=float(sys.argv[3])).start()
Path(sys.argv[2], "ready.json").write_text(json.dumps({"guard": server.proc.pid, "port": server.port}))
time.sleep(3600)
"""


def test_sigkill_of_the_starting_process_takes_the_whole_engine_down(smollm2_path, tmp_path, processes_mentioning):
    """The trainer (here: a process that started an engine) dies by SIGKILL, as after a cancel past its grace
    or when the supervisor is killed: the guard sees it and kills every engine process."""
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    marker = str(smollm2_path)
    before = set(processes_mentioning(marker))
    starter = subprocess.Popen([sys.executable, "-c", STARTER, marker, str(tmp_path), str(ENGINE_READY_S)],
                               cwd=REPO, start_new_session=True)
    try:
        # ready.json is written once /health answered 200; a start that fails or times out ends the starter
        wait_until(lambda: (tmp_path / "ready.json").exists() or starter.poll() is not None, BOUND_S, "the engine")
        assert starter.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
        info = json.loads((tmp_path / "ready.json").read_text())
        engine = set(processes_mentioning(marker)) - before - {starter.pid}
        assert len(engine) >= 2  # the guard and vLLM's API server (its engine core runs beside them)
        assert info["guard"] in engine
        group = os.getpgid(next(p for p in engine if p != info["guard"]))
        assert group != os.getpgid(starter.pid)  # not in the starter's group: a killpg of it misses them
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        wait_until(lambda: not (set(processes_mentioning(marker)) - before - {starter.pid}), PROCESS_S,
                   "the engine to go")
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)  # nothing of the engine's process group is left
    finally:
        if starter.poll() is None:
            os.killpg(starter.pid, signal.SIGKILL)


def test_an_engine_that_cannot_load_the_target_fails_with_the_reason(tmp_path, processes_mentioning):
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    server = VllmServer(EngineConfig(model=str(bad), max_model_len=128), log_path=tmp_path / "engine.log",
                        name="regeneration engine", startup_timeout_s=ENGINE_READY_S)  # it exits long before
    with pytest.raises(EngineError) as err:
        server.start()
    text = str(err.value)
    assert text.startswith("regeneration engine exited with code ")
    assert "vllm.entrypoints.openai.api_server --model " + str(bad) in text  # the command
    assert "last lines of its log (engine.log): " in text and "no_such_architecture" in text  # the reason
    assert not processes_mentioning(str(bad))
    assert err.value.code == "engine_failed"


def test_no_vllm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("peagle.engine.server.vllm_python", lambda: None)
    with pytest.raises(EngineError, match=r"vLLM is not installed: run `make vllm-env`"):
        VllmServer(EngineConfig(model="x"), log_path=tmp_path / "e.log").start()


def test_guard_takes_the_group_down_when_its_parent_dies(tmp_path, processes_mentioning):
    """The guard alone (no vLLM): a grandchild that ignores SIGTERM is SIGKILLed after the grace."""
    guard = REPO / "peagle" / "engine" / "guard.py"
    marker = f"peagle-guard-test-{os.getpid()}"
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, {str(guard)!r}, '--grace', '1', '--', sys.executable, '-c', "
         f"{script!r}, {marker!r}], start_new_session=True)\n"
         "time.sleep(600)\n"],
        start_new_session=True,
    )
    try:
        wait_until(lambda: len(processes_mentioning(marker)) >= 3, PROCESS_S, "guard, command and grandchild")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not processes_mentioning(marker), PROCESS_S, "the group to be killed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_job_whose_target_vllm_cannot_run_fails_at_capture_with_the_reason(tmp_path, tiny_target_path, processes_mentioning):
    """`peagle train` with the target in vLLM, on a model vLLM's CPU attention refuses (head_dim 16, found
    only at its first request): the job ends in its capturing phase, exit code 11 (engine_failed), the
    message names the command and quotes the engine's own reason, and no engine process is left."""
    from peagle.engine.locate import vllm_python
    from peagle.errors import EXIT_CODES

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    import shutil

    target = tmp_path / "my-tiny-model"  # a local folder, not the builtin (which the spec keeps in transformers)
    shutil.copytree(tiny_target_path, target)
    spec = {"target": {"model": str(target), "dtype": "float32"},
            "data": {"sources": [{"path": "builtin:sharegpt", "max_samples": 8}], "max_length": 64},
            "draft": {"num_layers": 1, "draft_vocab_size": 256}, "peagle": {"num_depths": 2},
            "optim": {"max_steps": 2, "pack_length": 128}, "eval": {"prompt_sets": []},
            "resources": {"device": "cpu", "target_engine": "vllm", "capture": "offline"}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "peagle", "train", str(tmp_path / "spec.json"), "--out", str(run),
                           "--progress-jsonl", "-"], cwd=REPO, capture_output=True, text=True,
                          timeout=BOUND_S)  # fmt: skip
    assert proc.returncode == EXIT_CODES["engine_failed"], proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    phases = [r["phase"] for r in records if r.get("kind") == "phase"]
    assert phases[-1] == "capturing", phases
    error = next(r for r in records if r.get("kind") == "error")
    assert error["code"] == "engine_failed"
    assert "capture engine answered 500" in error["message"], error
    assert "vllm.entrypoints.openai.api_server --model" in error["message"]
    assert "head_dim=16" in error["message"]  # the engine's own reason, from its log
    assert not processes_mentioning(str(target))
