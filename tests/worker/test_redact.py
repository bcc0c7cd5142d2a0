"""Issue 19: what the worker stores for clients (events, logs, errors, resolved spec) names no server path."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from service.settings import get_settings
from worker.redact import Redactor
from worker.supervisor import Supervisor


def test_redactor_replaces_server_paths(tmp_path: Path) -> None:
    s = get_settings(home=tmp_path / "home", artifact_root=tmp_path / "art", dataset_root=tmp_path / "ds")
    run = s.resolved_artifact_root() / "job_1"
    ds_file = s.resolved_dataset_root() / "7" / "ds_a" / "chats.jsonl"
    r = Redactor(s, run, {str(ds_file): "ds_a"})
    msg = f"{ds_file}: line 3: invalid; see {run}/train.log; {sys.prefix}/lib/x.py; {s.resolved_dataset_root()}/9"
    out = r.text(msg)
    assert str(tmp_path) not in out and sys.prefix not in out
    assert out.startswith("dataset:ds_a: line 3") and "<run>/train.log" in out
    assert r.value({"argv": [sys.executable, "train", str(run / "job_spec.json")]}) == {
        "argv": [sys.executable.replace(sys.prefix, "<python>"), "train", "<run>/job_spec.json"]}


def test_resolved_spec_keeps_the_owners_refs(tmp_path: Path) -> None:
    s = get_settings(home=tmp_path / "home", artifact_root=tmp_path / "art", dataset_root=tmp_path / "ds")
    ds_file = str(s.resolved_dataset_root() / "7" / "ds_a" / "chats.jsonl")
    sup: Any = Supervisor.__new__(Supervisor)
    sup.lease = type("L", (), {"spec": {"data": {"sources": [{"path": "dataset:ds_a"}]}}})()
    sup.redact = Redactor(s, s.resolved_artifact_root() / "job_1", {ds_file: "ds_a"})
    resolved = {"target": {"model": str(Path.home() / ".cache/peagle/tiny")},
                "data": {"sources": [{"path": ds_file, "format": "sharegpt"}]}}
    out = sup._public_spec(resolved)
    assert out["data"]["sources"] == [{"path": "dataset:ds_a", "format": "sharegpt"}]
    assert str(Path.home()) not in str(out) and str(tmp_path) not in str(out)


def test_redactor_replaces_service_addresses_and_pids(tmp_path: Path) -> None:
    s = get_settings(home=tmp_path / "home", database_url="postgresql+psycopg://peagle:pw@db:5432/peagle",
                     redis_url="redis://127.0.0.1:6393/0", broker_url="redis://cache:6379/1")
    r = Redactor(s, s.resolved_artifact_root() / "job_1")
    assert r.text("Error 111 connecting to 127.0.0.1:6393. Connection refused.") == \
        "Error 111 connecting to <address>. Connection refused."
    assert r.text("Error -2 connecting to cache:6379. Name or service not known.") == \
        "Error -2 connecting to <address>. Name or service not known."
    assert r.text("cannot reach postgresql+psycopg://peagle:pw@db:5432/peagle") == "cannot reach <url>"
    assert r.text("engine at http://10.1.2.3:8000/v1 ([::1]:80, localhost:41234)") == \
        "engine at <url> (<address>, <address>)"
    assert r.text("(EngineCore pid=4242) died; pid 17 gone") == "(EngineCore pid=<pid>) died; pid <pid> gone"
    kept = "see https://huggingface.co/org/model, version 1.2.3, step 12:30"
    assert r.text(kept) == kept  # public sites, versions and times are not infrastructure
