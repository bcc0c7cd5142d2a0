"""`peagle jobs retrain` and `peagle promotion ...` as a user runs them, against a real uvicorn server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from api.main import create_app
from peagle.cli import app as cli_app
from peagle.client import PeagleClient
from service.db import promotion
from service.db.session import session_scope
from tests.api.test_retrain import EXPORT_CONFIG


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_retrain_and_promotion_from_the_command_line(settings_factory: Any, sim: Any, live_server: Any,
                                                     tmp_path: Any) -> None:
    key = sim.key("ivy", "write")
    data = tmp_path / "new.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    runner = CliRunner()
    with live_server(create_app(settings_factory())) as srv, PeagleClient(srv.url, key) as c:
        parent = c.submit(preset="tiny")["id"]
        sim.set(parent, status="succeeded")
        (sim.checkpoint(parent, 4, {"model.safetensors": b"\0"}) / "config.json").write_text(json.dumps(EXPORT_CONFIG))
        base = ["--url", srv.url, "--api-key", key]

        res = runner.invoke(cli_app, ["jobs", "retrain", parent, "--data", str(data), "--data", "builtin:sharegpt",
                                      "--max-steps", "3", "--batch-size", "1", "--batch-size", "8", *base])
        assert res.exit_code == 0, res.output
        child = json.loads(res.stdout[res.stdout.index("{"):])
        assert child["spec"]["draft"]["init_from"] == f"job:{parent}"
        assert child["spec"]["optim"]["max_steps"] == 3
        paths = [s["path"] for s in child["spec"]["data"]["sources"]]
        assert paths[0].startswith("dataset:") and paths[1] == "builtin:sharegpt"
        with session_scope(sim.sessions) as s:
            link = promotion.retrain_of(s, child["id"])
            assert link is not None and link.batch_sizes == [1, 8]

        res = runner.invoke(cli_app, ["jobs", "retrain", child["id"], "--data", "builtin:sharegpt", *base])
        assert res.exit_code == 1 and "only a succeeded job can be retrained" in res.output, res.output
        res = runner.invoke(cli_app, ["jobs", "retrain", parent, "--data", str(tmp_path / "missing.jsonl"), *base])
        assert res.exit_code == 2 and "not a file here" in res.output, res.output

        res = runner.invoke(cli_app, ["promotion", "promote", parent, *base])
        assert res.exit_code == 0 and json.loads(res.stdout)["decision"] == "forced", res.output
        res = runner.invoke(cli_app, ["promotion", "current", *base])
        assert res.exit_code == 0 and f"builtin:tiny-llama: {parent} step 4" in res.stdout, res.output
        res = runner.invoke(cli_app, ["promotion", "undo", "builtin:tiny-llama", *base])
        assert res.exit_code == 0 and json.loads(res.stdout)["decision"] == "undone", res.output
        res = runner.invoke(cli_app, ["promotion", "decisions", "--job", parent, *base])
        assert res.exit_code == 0, res.output
        assert [line.split()[1] for line in res.stdout.splitlines()] == ["undone", "forced"]
        res = runner.invoke(cli_app, ["promotion", "current", *base])
        assert res.stdout.strip() == "no current draft"
