"""Every vLLM process (the probe, `vllm serve`) dies with what started it, leaves no temporary folder,
and never sees the worker's secrets (slow: real vLLM, real processes, read through /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.engine.server import EngineConfig, VllmServer
from tests.cli.conftest import smollm2_and_draft
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SECRETS = {"PEAGLE_SECRET_KEY": "probe-test-secret-key-0123456789abcdef",
           "PEAGLE_DATABASE_URL": "postgresql+psycopg://peagle:hunter2@db.internal:5432/peagle",
           "PEAGLE_REDIS_URL": "redis://:hunter2@redis.internal:6379/0"}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def leftovers(tmp: Path) -> list[str]:
    """What is in `tmp` besides torch's compile cache (`torchinductor_<user>`, kept on purpose: later engines
    reuse it, `peagle.engine.environment.vllm_env`)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


# What the trainer does at its live AL evaluation (`peagle.eval.live`): a probe on the checkpoint's export.
TRAINER = """
import sys
from peagle.eval.serve_check import run_vllm_probe
run_vllm_probe(sys.argv[1], [[1, 2, 3, 4, 5, 6, 7, 8]] * 4, max_new_tokens=512)
"""


@pytest.fixture(scope="module")
def smollm2_export(smollm2_path, tmp_path_factory) -> Path:
    from peagle.export.writer import export_draft

    _target, draft = smollm2_and_draft(smollm2_path, copy_layers=False)
    return export_draft(draft, tmp_path_factory.mktemp("probe") / "export", num_speculative_tokens=3,
                        verifier_name_or_path=str(smollm2_path), verifier_architectures=["LlamaForCausalLM"])


def test_sigkill_of_the_trainer_during_a_probe_leaves_no_process_and_no_temp_folder(
        smollm2_export, tmp_path, processes_mentioning):
    """`kill -9` of the trainer while its probe loads vLLM: the probe's whole group goes, its temporary
    folder (plan, result, log) is removed, and the probe never saw the worker's secrets."""
    tmp = tmp_path / "tmp"  # the trainer's TMPDIR: its probe folder is made here, and named on its command line
    tmp.mkdir()
    env = {**os.environ, **SECRETS, "TMPDIR": str(tmp)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(smollm2_export)], cwd=REPO, env=env,
                               start_new_session=True)
    marker = str(tmp)
    try:
        wait_until(lambda: processes_mentioning(marker) or trainer.poll() is not None, 120, "the probe")
        assert trainer.poll() is None, "the trainer ended before its probe started"
        # the probe is loading vLLM: its log (in the probe's folder) says the engine is being initialised
        def loading() -> bool:
            return any("Initializing a V1 LLM engine" in f.read_text(errors="replace")
                       for f in tmp.glob("peagle-vllm-*/vllm.log"))

        wait_until(lambda: loading() or trainer.poll() is not None, 300, "the probe to start vLLM's engine")
        assert trainer.poll() is None, "the trainer ended while its probe started vLLM"
        probes = set(processes_mentioning(marker))
        assert probes and leftovers(tmp), "the probe and its temp folder"
        leaked = {pid: sorted(set(SECRETS) & set(environ_of(pid))) for pid in probes}
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        wait_until(lambda: not processes_mentioning(marker), 60, "every probe process to go")
        wait_until(lambda: not leftovers(tmp), 30, f"the probe's temp folder to go (left: {leftovers(tmp)})")
        assert not any(leaked.values()), leaked
    finally:
        for pid in processes_mentioning(marker):  # never leave an orphan running (what today's code did)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)


def test_a_real_engine_does_not_inherit_the_workers_secrets(smollm2_path, tmp_path, monkeypatch, processes_mentioning):
    """PEAGLE_SECRET_KEY / PEAGLE_DATABASE_URL / PEAGLE_REDIS_URL set in the process that starts `vllm serve`:
    none of them is in the environment of the guard or of any vLLM process (/proc/<pid>/environ)."""
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # allowed through: proves the filter keeps what vLLM needs
    marker = str(smollm2_path)
    before = set(processes_mentioning(marker))
    cfg = EngineConfig(model=marker, dtype="bfloat16", max_model_len=256)
    with VllmServer(cfg, log_path=tmp_path / "engine.log", startup_timeout_s=600) as server:
        assert server.proc is not None
        pids = (set(processes_mentioning(marker)) - before) | {server.proc.pid}
        assert len(pids) >= 2  # the guard and vLLM's API server
        for pid in pids:
            seen = environ_of(pid)
            assert not set(SECRETS) & set(seen), (pid, sorted(set(SECRETS) & set(seen)))
            assert seen.get("OMP_NUM_THREADS") == "1" and seen.get("HF_HUB_OFFLINE") == "1"
