"""peagle.client and `peagle jobs ...` against a real uvicorn server."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.main import create_app
from peagle.cli import app as cli_app
from peagle.client import PeagleClient, ServiceError


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_client_and_cli(settings_factory: Any, sim: Any, live_server: Any, tmp_path: Path, db_url: str,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    key = sim.key("hank", "write")
    with live_server(create_app(settings_factory())) as srv, PeagleClient(srv.url, key) as c:
        job = c.submit(preset="tiny", idempotency_key="x")
        assert c.submit(preset="tiny", idempotency_key="x")["id"] == job["id"]
        with pytest.raises(ServiceError) as ei:
            c.submit({"target": {"model": "m"}, "peagle": {"num_depths": 99}})
        assert ei.value.status == 422 and ei.value.details[0]["param"] == "/peagle/num_depths"
        assert [j["id"] for j in c.list_jobs(limit=1)] == [job["id"]]
        jid = job["id"]
        sim.set(jid, status="running")
        blob = b"weights" * 1000
        sim.checkpoint(jid, 8, {"model.safetensors": blob, "config2.json": b"{}", "training_state.pt": b"opt" * 99})

        def finish() -> None:
            time.sleep(0.3)
            sim.emit(jid, "logs", 3)
            sim.set(jid, status="succeeded")

        threading.Thread(target=finish).start()
        env = {"PEAGLE_URL": srv.url, "PEAGLE_API_KEY": key}
        runner = CliRunner()
        r = runner.invoke(cli_app, ["jobs", "logs", jid, "--follow"], env=env)
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()  # where the job is first and last (tests/api/test_jobs_follow.py)
        assert lines[0].startswith(f"job {jid}: running") and lines[-1].startswith(f"job {jid}: succeeded")
        assert [ln.split()[-1] for ln in lines[1:-1]] == ["1", "2", "3"]
        r = runner.invoke(cli_app, ["jobs", "list"], env=env)
        assert jid in r.output and "succeeded" in r.output
        assert json.loads(runner.invoke(cli_app, ["jobs", "get", jid], env=env).output)["id"] == jid
        # resumable download: a partial file is completed with Range and verified
        out = tmp_path / "dl"
        out.mkdir()
        (out / "model.safetensors.part").write_bytes(blob[:1000])
        r = runner.invoke(cli_app, ["jobs", "download", jid, "--out", str(out)], env=env)
        assert r.exit_code == 0, r.output
        assert hashlib.sha256((out / "model.safetensors").read_bytes()).digest() == hashlib.sha256(blob).digest()
        # what vLLM reads only; the optimizer state on request
        assert sorted(p.name for p in out.iterdir()) == ["config2.json", "model.safetensors"]
        r = runner.invoke(cli_app, ["jobs", "download", jid, "--out", str(out), "--training-state"], env=env)
        assert r.exit_code == 0 and (out / "training_state.pt").read_bytes() == b"opt" * 99, r.output
        # no --out: the folder the archive unpacks to, and the serve endpoint's command serves it as printed
        monkeypatch.chdir(tmp_path)
        r = runner.invoke(cli_app, ["jobs", "download", jid], env=env)
        assert r.exit_code == 0, r.output
        assert (tmp_path / f"{jid}-step_000008" / "model.safetensors").read_bytes() == blob
        serve = c.serve_command(jid, 8)
        assert r.output.splitlines()[-1] == f"serve with: {serve['command']}" == f"serve with: vllm serve ./{jid}-step_000008"
        r = runner.invoke(cli_app, ["jobs", "cancel", jid], env=env)
        assert r.exit_code == 1 and "illegal_transition" in r.output
        r = runner.invoke(cli_app, ["jobs", "submit", "--preset", "tiny", "--dry-run"], env=env)
        assert r.exit_code == 0 and json.loads(r.output)["object"] == "estimate"
