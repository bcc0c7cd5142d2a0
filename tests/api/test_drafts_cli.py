"""`peagle drafts upload|list|delete` and `PeagleClient.upload_draft` as a user runs them, against a real
uvicorn server: a folder is packed and uploaded (ready, its `draft:<id>` starts a job), an archive is sent as
it is, a folder that is not an export is `invalid` with the validator's reason (exit 1)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.main import create_app
from peagle.cli import app as cli_app
from peagle.client import PeagleClient


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_drafts_from_the_command_line(settings_factory: Any, sim: Any, live_server: Any, tmp_path: Path,
                                      tiny_export: Path) -> None:
    key = sim.key("ivy", "write")
    runner = CliRunner()
    with live_server(create_app(settings_factory())) as srv, PeagleClient(srv.url, key) as c:
        base = ["--url", srv.url, "--api-key", key]
        res = runner.invoke(cli_app, ["drafts", "upload", str(tiny_export), *base])
        assert res.exit_code == 0, res.output
        draft_id, status, init_from = res.stdout.split()
        assert status == "ready" and init_from == f"init_from=draft:{draft_id}", res.stdout
        up = c.get_draft(draft_id)
        assert up["filename"] == f"{tiny_export.name}.tar.gz"
        assert up["report"]["facts"]["aux_layer_ids"] == [1, 2, 3]

        # an archive goes as it is
        archive = tmp_path / "d.tar.gz"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for f in sorted(tiny_export.iterdir()):
                tar.add(f, arcname=f.name)
        archive.write_bytes(buf.getvalue())
        second = c.upload_draft(archive)
        assert (second["status"], second["filename"], second["size"]) == ("ready", "d.tar.gz", len(buf.getvalue()))

        # not an export: invalid, with the validator's reason
        junk = tmp_path / "junk"
        junk.mkdir()
        (junk / "config.json").write_text(json.dumps({"architectures": ["Nothing"]}))
        res = runner.invoke(cli_app, ["drafts", "upload", str(junk), *base])
        assert res.exit_code == 1 and " invalid: " in res.stdout, res.output
        res = runner.invoke(cli_app, ["drafts", "upload", str(tmp_path / "missing"), *base])
        assert res.exit_code == 2 and "no such file or folder" in res.output, res.output

        res = runner.invoke(cli_app, ["drafts", "list", *base])
        assert res.exit_code == 0, res.output
        rows = [line.split() for line in res.stdout.splitlines()]
        assert [(r[0], r[1]) for r in rows][1:] == [(second["id"], "ready"), (draft_id, "ready")]
        assert rows[0][1] == "invalid"

        job = c.submit(preset="tiny", overrides={"draft": {"init_from": f"draft:{draft_id}"}})
        assert c.get_job(job["id"])["spec"]["draft"]["init_from"] == f"draft:{draft_id}"
        res = runner.invoke(cli_app, ["drafts", "delete", draft_id, *base])
        assert res.exit_code == 1 and "is named by unfinished job" in res.output, res.output
        res = runner.invoke(cli_app, ["drafts", "delete", second["id"], *base])
        assert res.exit_code == 0 and f"deleted {second['id']}" in res.stdout, res.output
        assert [d["id"] for d in c.list_drafts()][1:] == [draft_id]
