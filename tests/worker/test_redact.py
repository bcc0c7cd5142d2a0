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
