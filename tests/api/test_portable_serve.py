"""The serve command names what exists on the user's machine: the unpacked folder and a portable verifier."""

from __future__ import annotations

import json
import shlex
from typing import Any

from fastapi.testclient import TestClient

from service.settings import Settings


def _serve(client: TestClient, alice: dict, sim: Any, preset: str, verifier: str) -> tuple[str, dict[str, Any]]:
    job = client.post("/v1/jobs", json={"preset": preset}, headers=alice).json()
    d = sim.checkpoint(job["id"], 4, {"model.safetensors": b"w"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = verifier
    (d / "config.json").write_text(json.dumps(cfg))
    r = client.get(f"/v1/jobs/{job['id']}/checkpoints/4/serve", headers=alice)
    assert r.status_code == 200, r.text
    return job["id"], r.json()


def test_short_command_serves_the_unpacked_folder(client: TestClient, alice: dict, sim: Any) -> None:
    jid, serve = _serve(client, alice, sim, "tiny", "t/v")
    folder = f"{jid}-step_000004"  # what the archive unpacks to and `peagle jobs download` writes by default
    assert serve["model_dir"] == folder
    assert shlex.split(serve["command"]) == ["vllm", "serve", f"./{folder}"]
    long = shlex.split(serve["long_command"])
    assert long[:3] == ["vllm", "serve", "t/v"] and long[3] == "--speculative-config"
    assert json.loads(long[4])["model"] == f"./{folder}" == serve["speculative_config"]["model"]


def test_a_host_path_verifier_becomes_the_builtin_hub_id(client: TestClient, alice: dict, sim: Any,
                                                          settings: Settings) -> None:
    # an export written before verifiers were portable: the builtin's cache folder on the training host
    host = "/root/.cache/peagle/SmolLM2-135M-Instruct"
    _jid, serve = _serve(client, alice, sim, "demo", host)
    text = json.dumps(serve)
    assert host not in text and str(settings.resolved_artifact_root()) not in text
    assert shlex.split(serve["long_command"])[2] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_verifier_without_hub_copy_comes_with_a_note(client: TestClient, alice: dict, sim: Any) -> None:
    _jid, tiny = _serve(client, alice, sim, "tiny", "builtin:tiny-llama")
    assert tiny["note"] and "peagle fixtures tiny" in tiny["note"]
    _jid, demo = _serve(client, alice, sim, "demo", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert demo["note"] is None
