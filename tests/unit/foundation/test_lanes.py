"""The suite's two lanes (docs/testing.md 1): heavy tests are marked at collection, and the fast lane refuses
what a heavy test does (vLLM's interpreter is a tripwire; a worker stack does not start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.lane import VLLM_TRIPWIRE, real_vllm_env

REPO = Path(__file__).resolve().parents[3]


def _pytest(*args: str, lane: str = "") -> subprocess.CompletedProcess[str]:
    env = real_vllm_env({**os.environ, "PEAGLE_TEST_LANE": lane})  # this run may be the fast lane itself
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def _collected(out: str) -> set[str]:
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_heavy_tests_are_marked_by_their_markers_and_fixtures() -> None:
    files = ["tests/worker/test_quota.py", "tests/engine/test_k_schedule.py", "tests/unit/spec/test_vllm_extra_args.py"]
    heavy = _collected(_pytest("--collect-only", "-m", "heavy", *files).stdout)
    light = _collected(_pytest("--collect-only", "-m", "not heavy", *files).stdout)
    # a worker stack (make_stack), a slow module (a real engine), a test marked slow in a unit module
    assert "tests/worker/test_quota.py::test_real_workers_run_one_job_at_a_time_per_owner" in heavy
    assert any(t.startswith("tests/engine/test_k_schedule.py::") for t in heavy)
    assert any("test_vllm_extra_args.py::test_what_vllm_itself_reads" in t for t in heavy)
    # a database-only test and a pure unit test stay in the fast lane
    assert "tests/worker/test_quota.py::test_claim_respects_owner_limit_and_defers[sqlite]" in light
    assert not any(t.startswith("tests/engine/") for t in light)
    assert heavy and light and not heavy & light


def test_the_tripwire_fails_naming_the_lane() -> None:
    proc = subprocess.run([str(VLLM_TRIPWIRE), "-m", "vllm.entrypoints.openai.api_server"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 3 and "fast lane" in proc.stderr and "mark this test slow" in proc.stderr


def test_in_the_fast_lane_a_worker_stack_is_refused_and_vllm_is_the_tripwire(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe_lane.py"
    probe.write_text(
        "from tests.worker.conftest import Stack\n\n"
        "def test_vllm_is_the_tripwire():\n"
        "    from peagle.engine.locate import vllm_python\n"
        "    from tests.lane import VLLM_TRIPWIRE\n"
        "    assert vllm_python() == VLLM_TRIPWIRE\n\n"
        "def test_a_stack(tmp_path):\n"
        "    Stack(tmp_path, database_url=f'sqlite:///{tmp_path}/db', broker_url=None, redis_url=None,\n"
        "          fake_trainer=True)\n"
    )
    # outside tests/, so the suite's conftest comes in as a plugin (its lane fixture and hooks)
    args = (str(probe), "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "-p", "tests.conftest")
    fast = _pytest(*args, lane="fast")
    assert fast.returncode == 1, fast.stdout[-3000:]
    assert "1 failed, 1 passed" in fast.stdout and "a worker stack in the fast lane" in fast.stdout, fast.stdout[-3000:]
    full = _pytest(*args, "-k", "tripwire")
    assert full.returncode == 1 and "1 failed" in full.stdout, full.stdout[-3000:]  # outside the lane: the real one
