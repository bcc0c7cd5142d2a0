"""The torch-free file protocol of a split job (`peagle.split.protocol`): one marker name for both sides, what
is pending, the trainer's wait, the regeneration plan's replacement, the engine key; and that importing it
loads no torch (the capture side's batches are tests/unit/data/test_remote_source.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from peagle.errors import EngineError
from peagle.split import protocol as p

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Settings:  # stands for `peagle.data.regenerate.RegenSettings` (a dataclass)
    engine: str = "vllm"
    seed: int = 0


def test_importing_the_protocol_loads_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, peagle.split.protocol; print(sorted(m for m in "
                          "('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules))"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_folders_and_one_marker_name(tmp_path: Path) -> None:
    run = tmp_path / "job"
    assert p.remote_dir(run) == run / "data" / "features" / "remote"
    assert p.regen_dir(run) == run / "data" / "regenerate" / "remote"
    assert p.eval_dir(p.remote_dir(run)) == run / "data" / "features" / "eval"
    assert p.mb_file(p.remote_dir(run), 7).name == "mb_00000007.safetensors"
    assert p.done_file(p.regen_dir(run), 3).name == "chunk_000003.done" == p.done_file(p.remote_dir(run), 3).name
    assert p.chunk_dir(p.regen_dir(run), 3).name == "chunk_000003"


def test_capture_chunks_pending_per_generation(tmp_path: Path) -> None:
    d = tmp_path
    plan = p.capture_plan(num_rows=10, pack_length=8, hidden_size=4, micro_batch_size=2, seed=0,
                          total_micro_batches=6, aux_layer_ids=[1], chunk_micro_batches=2)
    assert plan["chunks"] == [[0, 2], [2, 4], [4, 6]] and p.chunk_range(plan, 2) == (4, 6)
    assert p.pending_chunks(d) == []  # no plan yet
    p.publish_plan(d, plan)
    assert p.pending_chunks(d) == []  # nothing released yet
    p.write_release(d, generation=2, start=0, consumed=-1, released=2)
    assert p.read_release(d) == {"generation": 2, "start": 0, "consumed": -1, "released": 2}
    p.write_done(d, 0, {"generation": 1})  # an older stream's marker does not count
    assert p.pending_chunks(d) == [0, 1]
    p.write_done(d, 0, {"generation": 2})
    assert p.pending_chunks(d) == [1]
    p.write_release(d, generation=2, start=0, consumed=3, released=3)  # chunk 1 read already
    assert p.pending_chunks(d) == [2]


def test_micro_batch_files_are_dropped_and_counted(tmp_path: Path) -> None:
    for j in range(4):
        p.mb_file(tmp_path, j).write_bytes(b"x" * (j + 1))
    assert p.bytes_ahead(tmp_path) == 1 + 2 + 3 + 4
    p.drop_micro_batches(tmp_path, upto=1)
    assert sorted(f.name for f in tmp_path.glob("mb_*")) == ["mb_00000002.safetensors", "mb_00000003.safetensors"]
    p.drop_micro_batches(tmp_path)
    assert not list(tmp_path.glob("mb_*"))
    p.log_consumed(tmp_path, 0)
    p.log_consumed(tmp_path, 1)
    assert (tmp_path / p.CONSUMED_LOG).read_text().split() == ["0", "1"]


def test_regeneration_plan_pending_and_replaced(tmp_path: Path) -> None:
    d = p.regen_dir(tmp_path)
    plan = p.regen_plan(keys=["a", "b", "c"], settings=Settings(), identity={"model": "m"}, group="g", spec={},
                        chunk_size=2)
    assert plan["chunks"] == [[0, 2], [2, 3]] and plan["settings"] == {"engine": "vllm", "seed": 0}
    p.write_regen_plan(d, plan, [[{"role": "user", "content": "hi"}]] * 3)
    assert p.read_conversations(d)[0] == [{"role": "user", "content": "hi"}]
    assert p.pending_regen_chunks(d) == [0, 1]
    p.write_done(d, 1, {"plan_id": plan["plan_id"]})
    assert p.pending_regen_chunks(d) == [0]
    other = p.regen_plan(keys=["a", "d"], settings=Settings(), identity={}, group="g", spec={}, chunk_size=2)
    p.write_regen_plan(d, other, [[]] * 2)  # another attempt's conversations: the old chunks go
    assert p.pending_regen_chunks(d) == [0] and not p.done_file(d, 1).exists()
    p.publish_plan(d, {**other, "version": 99})
    with pytest.raises(EngineError, match="plan version 99"):
        p.read_regen_plan(d)


def test_the_wait_raises_the_dispatchers_failure_or_times_out(tmp_path: Path) -> None:
    calls = iter([True, False])
    assert p.wait_while(lambda: next(calls), failed_dir=tmp_path, what="x", poll_s=0.0, timeout_s=None) >= 0.0
    with pytest.raises(EngineError, match="did not arrive from the engine workers in 0 s"):
        p.wait_while(lambda: True, failed_dir=None, what="the regenerated answers", poll_s=0.01, timeout_s=0.05)
    p.write_failed(tmp_path, "engine chunk capture 2 failed 3 times on engine workers")
    assert p.read_failed(tmp_path) == {"message": "engine chunk capture 2 failed 3 times on engine workers"}
    with pytest.raises(EngineError, match="chunk capture 2 failed"):
        p.wait_while(lambda: True, failed_dir=tmp_path, what="x", poll_s=0.01, timeout_s=None)


def test_engine_key_names_the_engine_not_the_job() -> None:
    spec = {"target": {"model": "m", "revision": None, "dtype": "bfloat16"}, "resources": {"vllm": {}},
            "optim": {"seed": 0}, "data": {"sources": ["one job's data"]}}
    capture = {"spec": spec, "kind": "capture", "aux_layer_ids": [1, 2]}
    other_job = {**capture, "spec": {**spec, "data": {"sources": ["another's"]}}}
    assert p.engine_key(capture) == p.engine_key(other_job)
    assert p.engine_key(capture) != p.engine_key({**capture, "kind": "regenerate", "aux_layer_ids": []})
