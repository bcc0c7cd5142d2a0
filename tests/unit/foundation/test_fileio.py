"""peagle.fileio: atomic writes leave the old content or the new, never a partial file or directory."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.fileio import atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text, publish_dir


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


@pytest.mark.parametrize("durable", [False, True])
def test_write_bytes_text_json_content_and_mode(tmp_path: Path, durable: bool) -> None:
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01", durable=durable)
    atomic_write_text(tmp_path / "t.txt", "héllo", durable=durable, mode=0o600)
    atomic_write_json(tmp_path / "j.json", {"b": 1, "a": [1.5]}, sort_keys=True, newline=True, durable=durable)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    text = (tmp_path / "j.json").read_text(encoding="utf-8")
    assert text == json.dumps({"a": [1.5], "b": 1}, indent=2) + "\n"
    assert _mode(tmp_path / "b.bin") == 0o644
    assert _mode(tmp_path / "t.txt") == 0o600
    assert _leftovers(tmp_path, {"b.bin", "t.txt", "j.json"}) == []


def test_replaces_existing_file(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_text("old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert _leftovers(tmp_path, {"f"}) == []


def test_unserializable_json_leaves_no_file(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_json(p, {"x": object()})
    assert p.read_text() == "old"
    assert _leftovers(tmp_path, {"x.json"}) == []


def test_atomic_path_failure_keeps_old_file_and_removes_partial(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert p.read_bytes() == b"old"
    assert _leftovers(tmp_path, {"model.bin"}) == []


def test_atomic_path_writing_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), atomic_path(tmp_path / "never"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_killed_writer_leaves_old_content(tmp_path: Path) -> None:
    """A process killed between writing and renaming: the destination still holds the old bytes."""
    p = tmp_path / "state.json"
    p.write_text('{"v": 1}')
    code = (
        "import os, sys\n"
        "from peagle.fileio import atomic_path\n"
        f"with atomic_path({str(p)!r}) as tmp:\n"
        "    tmp.write_text('{\"v\": 2')\n"
        "    os._exit(9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.returncode == 9
    assert json.loads(p.read_text()) == {"v": 1}


def test_publish_dir_new_and_replace(tmp_path: Path) -> None:
    dest = tmp_path / "sub" / "out"
    with publish_dir(dest) as tmp:
        assert tmp.parent == dest.parent and not dest.exists()
        (tmp / "a.txt").write_text("1")
    assert (dest / "a.txt").read_text() == "1"
    assert _mode(dest) == 0o755
    with publish_dir(dest, durable=True) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]
    assert _leftovers(dest.parent, {"out"}) == []


def test_publish_dir_failure_keeps_old_dir(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("old")
    with pytest.raises(ValueError), publish_dir(dest) as tmp:
        (tmp / "partial.txt").write_text("x")
        raise ValueError("build failed")
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"]
    assert _leftovers(tmp_path, {"out"}) == []


def test_publish_dir_fixed_tmp_name_clears_a_stale_one(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-out-1"
    stale.mkdir()
    (stale / "junk").write_text("x")
    with publish_dir(tmp_path / "out", tmp_name=".tmp-out-1") as tmp:
        assert list(tmp.iterdir()) == []
        (tmp / "ok").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "ok").read_text() == "y"


def test_fileio_is_torch_free() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, peagle.fileio, peagle.spec.metrics; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
