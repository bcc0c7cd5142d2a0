"""peagle.run_folder: the run folder's names, formatted and parsed back, and the checks on what is in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle.run_folder import (
    CHECKPOINTS,
    COMPLETE,
    EXPORT,
    STATE_FILE,
    archive_cache_file,
    archive_file,
    archive_folder,
    checkpoint_relpath,
    complete_checkpoints,
    inside,
    is_complete,
    job_dir,
    job_ref,
    parse_job_ref,
    resolve_inside,
    step_dirname,
    step_of,
)


def test_the_names_of_the_layout() -> None:
    assert (CHECKPOINTS, EXPORT, STATE_FILE, COMPLETE) == ("checkpoints", "export", "state.json", "COMPLETE")
    assert step_dirname(100) == "step_000100" and step_dirname(1234567) == "step_1234567"
    assert checkpoint_relpath(40) == "checkpoints/step_000040"
    assert archive_folder("job_01AB", 40) == "job_01AB-step_000040"
    assert archive_file("job_01AB", 40) == "job_01AB-step_000040.tar"
    assert archive_cache_file(Path("/home"), "job_01AB", 40, "k1") == \
        Path("/home/cache/archives/job_01AB/step_000040-k1.tar")


@pytest.mark.parametrize("step", [0, 7, 100, 999999, 1000000])
def test_step_of_reads_back_step_dirname(step: int) -> None:
    assert step_of(step_dirname(step)) == step


@pytest.mark.parametrize("name", ["step_12", "step_", "step_00010a", ".tmp-step_000100-12", "export", "STEP_000100"])
def test_step_of_refuses_what_is_not_a_checkpoint_folder(name: str) -> None:
    assert step_of(name) is None


def test_job_dir_under_the_root_or_the_rows_artifact_dir(tmp_path: Path) -> None:
    assert job_dir(tmp_path, "job_01AB") == tmp_path / "job_01AB"
    assert job_dir(tmp_path, "job_01AB", artifact_dir="elsewhere/run") == tmp_path / "elsewhere/run"
    assert job_dir(tmp_path, "job_01AB", artifact_dir="/abs/run") == Path("/abs/run")


@pytest.mark.parametrize("job_id", ["", ".", "..", "../x", "a/b", "a\\b", "a\0b"])
def test_a_job_id_that_would_leave_the_root_is_refused(tmp_path: Path, job_id: str) -> None:
    with pytest.raises(ValueError, match="not a folder name"):
        job_dir(tmp_path, job_id)
    with pytest.raises(ValueError, match="not a folder name"):
        archive_folder(job_id, 1)


def test_complete_checkpoints_are_listed_by_step(tmp_path: Path) -> None:
    root = tmp_path / CHECKPOINTS
    assert complete_checkpoints(root) == []  # no folder yet
    for step in (999999, 5, 1000000, 40):
        d = root / step_dirname(step)
        d.mkdir(parents=True)
        (d / COMPLETE).write_text("ok\n")
    (root / step_dirname(60)).mkdir()  # interrupted: no marker
    (root / ".tmp-step_000070-1").mkdir()
    (root / ".tmp-step_000070-1" / COMPLETE).write_text("ok\n")
    (root / STATE_FILE).write_text("{}")
    assert [step_of(p.name) for p in complete_checkpoints(root)] == [5, 40, 999999, 1000000]
    assert is_complete(root / step_dirname(40)) and not is_complete(root / step_dirname(60))


def test_resolve_inside_refuses_names_that_leave_the_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (run / "out").symlink_to(tmp_path / "secret")
    assert resolve_inside(run, "checkpoints/step_000001") == (run / "checkpoints" / "step_000001").resolve()
    assert resolve_inside(run, ".") == run.resolve()  # the folder itself is inside
    for name in ("../secret", "/etc", "out", "checkpoints/../../secret"):
        assert resolve_inside(run, name) is None, name
    assert inside(run / "checkpoints", run) and not inside(tmp_path / "secret", run)


def test_job_ref_round_trips() -> None:
    assert job_ref("job_01AB") == "job:job_01AB" and job_ref("job_01AB", 40) == "job:job_01AB@step_40"
    assert parse_job_ref(job_ref("job_01AB")) == ("job_01AB", None)
    assert parse_job_ref(job_ref("job_01AB", 40)) == ("job_01AB", 40)
    for value in ("job:", "job:a/b", "job:x@step_", "job:x@step_1234567890", "job:x@40", "draft:x", "/runs/x"):
        assert parse_job_ref(value) is None, value
