"""The chunk protocol of a split job (`peagle.split.protocol`, `peagle.target.remote`): engine-side chunks
written whole, read by the trainer in its fixed order with the offline source's batches, released within the
disk budget, a chunk cut short redone by another executor, a resumed stream starting where the trainer asks.

The engine handle here is the in-process `TargetCapture` of a tiny target (the same `hidden` interface as
`VllmCapture`); two threads stand for two engine workers, both running `run_capture_chunk` on the files."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peagle.data.packing import pack_documents
from peagle.errors import EngineError
from peagle.fileio import atomic_write_json
from peagle.split.protocol import capture_plan, pending_chunks, releasable
from peagle.target.capture import TargetCapture
from peagle.target.remote import RemoteFeatureSource, run_capture_chunk, write_plan
from peagle.target.sources import OfflineFeatureSource, write_feature_shards


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(3)
    docs = [(torch.randint(20, 3000, (n,), generator=g).tolist(), [0] * 3 + [1] * (n - 3)) for n in
            (30, 41, 17, 25, 60, 33, 12, 48, 29, 36, 44, 21)]
    return pack_documents(docs, 64, seed=0)


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def _plan(rows, total, chunk, hidden=64):
    return capture_plan(num_rows=len(rows), pack_length=rows.input_ids.shape[1], hidden_size=hidden,
                        micro_batch_size=2, seed=5, total_micro_batches=total, aux_layer_ids=[1, 2, 3],
                        chunk_micro_batches=chunk)


class Serial:
    """One in-process target for both "engines": `TargetCapture` hooks its model's layers per call, so two
    threads must not run it at once (two engine workers are two processes with their own engines)."""

    def __init__(self, cap):
        self.cap, self.lock = cap, threading.Lock()

    def hidden(self, input_ids, document_ids):
        with self.lock:
            return self.cap.hidden(input_ids, document_ids)


class Engines:
    """Two executor threads taking pending chunks (what the worker's dispatcher and engine workers do)."""

    def __init__(self, d, cap, n=2):
        self.d, self.cap, self.stop = d, Serial(cap), threading.Event()
        self.errors: list[BaseException] = []
        self.ran: dict[int, list[str]] = {}
        self.lock = threading.Lock()
        self.taken: set[tuple[int, int]] = set()
        self.threads = [threading.Thread(target=self._run, args=(f"w{k}",), daemon=True) for k in range(n)]

    def _run(self, name):
        import json

        while not self.stop.is_set():
            gen = json.loads((self.d / "release.json").read_text())["generation"] if (self.d / "release.json").exists() else 0
            with self.lock:
                todo = [i for i in pending_chunks(self.d) if (gen, i) not in self.taken]
                if todo:
                    self.taken.add((gen, todo[0]))
            if not todo:
                time.sleep(0.02)
                continue
            try:
                run_capture_chunk(self.d, todo[0], self.cap, worker=name)
            except BaseException as exc:  # shown by the test
                self.errors.append(exc)
                raise
            self.ran.setdefault(todo[0], []).append(name)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_remote_batches_equal_offline_in_order(tiny_model, rows, tmp_path):
    cap = TargetCapture(tiny_model, "auto", torch.arange(0, 4000, 7))
    write_feature_shards(cap, rows, tmp_path / "off", rows_per_shard=3, aux_dtype=torch.float32)
    off = OfflineFeatureSource(tmp_path / "off", micro_batch_size=2, seed=5)
    nb = off.num_batches()
    d = tmp_path / "remote"
    write_plan(d, _plan(rows, 2 * nb, chunk=2), rows)
    src = RemoteFeatureSource(d, head_weight=cap.head_weight, head_bias=cap.head_bias, disk_budget_bytes=1e12,
                              timeout_s=120)
    with Engines(d, cap) as engines:
        for epoch in range(2):
            for index in range(nb):
                _equal(src.batch(epoch, index), off.batch(epoch, index))
                j = epoch * nb + index
                assert all(int(f.stem.split("_")[1]) > j for f in d.glob("mb_*")), j  # consumed ones deleted
    log = [int(x) for x in (d / "consumed.log").read_text().split()]
    assert not engines.errors
    assert log == list(range(2 * nb))  # no gap, no repeat
    assert {w for names in engines.ran.values() for w in names} == {"w0", "w1"}  # both executors worked


def test_budget_releases_only_what_fits_and_never_blocks():
    plan = {"chunks": [[0, 2], [2, 4], [4, 6], [6, 8]], "mb_bytes": 100}
    assert releasable(plan, start=0, consumed=-1, budget_bytes=1.0) == 1  # the next chunk always
    assert releasable(plan, start=0, consumed=-1, budget_bytes=400) == 2
    assert releasable(plan, start=0, consumed=2, budget_bytes=300) == 3  # [3, 6) fits in 300
    assert releasable(plan, start=5, consumed=4, budget_bytes=1.0) == 3  # chunks before the start count
    assert releasable(plan, start=0, consumed=-1, budget_bytes=1e9) == 4


def test_a_cut_chunk_is_redone_whole_and_a_resumed_stream_starts_there(tiny_model, rows, tmp_path):
    cap = TargetCapture(tiny_model, "auto", None)
    d = tmp_path / "remote"
    nb = -(-len(rows) // 2)
    assert nb >= 4
    write_plan(d, _plan(rows, 2 * nb, chunk=3), rows)
    src = RemoteFeatureSource(d, head_weight=cap.head_weight, head_bias=cap.head_bias, disk_budget_bytes=1.0)
    src.restart(0)
    assert pending_chunks(d) == [0]  # a 1-byte budget: one chunk at a time
    calls = iter(range(100))
    assert run_capture_chunk(d, 0, cap, should_stop=lambda: next(calls) >= 1) is None  # "killed" after one
    assert pending_chunks(d) == [0] and len(list(d.glob("mb_*"))) == 1
    assert run_capture_chunk(d, 0, cap, worker="other")["micro_batches"] == 3  # redone from its start
    first = src.batch(0, 0)
    assert first["input_ids"].shape[0] == 2 and pending_chunks(d) == []
    # a resumed trainer (new source, a later micro-batch): a new generation starting there
    again = RemoteFeatureSource(d, head_weight=cap.head_weight, head_bias=cap.head_bias, disk_budget_bytes=1.0)
    again.restart(4)
    assert pending_chunks(d) == [1] and not list(d.glob("mb_*"))
    stats = run_capture_chunk(d, 1, cap)
    assert stats["micro_batches"] == 2  # micro-batch 3 is before the stream's start: skipped
    again.batch(*divmod(4, nb))
    atomic_write_json(d / "failed.json", {"message": "chunk 2 failed 3 times on engine workers"})
    again.batch(*divmod(5, nb))  # written by chunk 1
    with pytest.raises(EngineError, match="chunk 2 failed"):
        again.batch(*divmod(6, nb))
