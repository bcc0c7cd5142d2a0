"""User mistakes end with ONE line on stderr and a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from peagle.cli import app
from peagle.errors import EXIT_CODES


def _peagle(*args: str):
    return CliRunner().invoke(app, list(args))


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def _ends_with_one_error_line(result) -> str:
    """A mistake found once the run started (issue 39: `peagle train` shows its progress on stderr): the
    progress lines, then ONE `error:` line, the last; never a traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    assert lines[0].startswith("peagle train "), result.stderr  # the progress came first
    return lines[-1]


def test_real_process_prints_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "peagle", "train", str(tmp_path / "nope.yaml"), "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == EXIT_CODES["spec_invalid"]
    assert proc.stderr.strip().splitlines() == [f"error: 1 problem in the job spec: (root): {tmp_path / 'nope.yaml'}: "
                                                "no such spec file (or preset name)"]  # fmt: skip


def test_train_invalid_spec_names_the_field(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"target": {"model": "builtin:tiny-llama"}, "peagle": {"num_depths": 0}}))
    r = _peagle("train", str(spec), "--out", str(tmp_path / "run"), "--progress-jsonl", "-")
    assert r.exit_code == EXIT_CODES["spec_invalid"]
    assert "peagle.num_depths" in _one_line(r)
    err = json.loads(r.stdout.splitlines()[-1])
    assert err["kind"] == "error" and err["code"] == "spec_invalid"


def test_train_unknown_target(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("target:\n  model: builtin:nope\n")
    r = _peagle("train", str(spec), "--out", str(tmp_path / "run"))
    assert r.exit_code == EXIT_CODES["target_load_failed"]
    assert "builtin:nope" in _ends_with_one_error_line(r)  # found while loading: after the progress lines
    err = json.loads((tmp_path / "run" / "progress.jsonl").read_text().splitlines()[-1])
    assert err["kind"] == "error" and err["code"] == "target_load_failed"


def test_validate_missing_and_invalid_dirs(tmp_path):
    r = _peagle("validate", str(tmp_path / "nope"))
    assert r.exit_code == EXIT_CODES["export_invalid"]
    assert "not a directory" in _one_line(r)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    r = _peagle("validate", str(tmp_path))
    assert r.exit_code == EXIT_CODES["export_invalid"]
    assert "speculators_config must be an object" in _one_line(r)
    r = _peagle("validate", str(tmp_path), "--json")
    assert r.exit_code == EXIT_CODES["export_invalid"] and json.loads(r.stdout)["ok"] is False


@pytest.mark.parametrize("cmd", [["export", "{d}", "--out", "{d}/x"], ["eval", "{d}", "--num-prompts", "1"]])
def test_export_and_eval_on_missing_dir(tmp_path, cmd):
    r = _peagle(*[a.format(d=tmp_path / "nope") for a in cmd])
    assert r.exit_code == EXIT_CODES["checkpoint_invalid"]
    assert "no such directory" in _one_line(r)


def test_eval_unknown_prompt_set(tmp_path, request):
    export = request.getfixturevalue("tmp_path") / "not_an_export"
    export.mkdir()
    r = _peagle("eval", str(export), "--prompts", "nope")
    assert r.exit_code == EXIT_CODES["checkpoint_invalid"]
    assert "not an export" in _one_line(r)


def test_bad_option_value_is_a_usage_error(tmp_path):
    r = _peagle("export", str(tmp_path), "--out", str(tmp_path / "x"), "--layout", "onnx")
    assert r.exit_code == EXIT_CODES["usage"]
    assert "Traceback" not in r.stderr
