"""The streaming source: same batches as the offline shards, within its disk budget, consumed files
deleted, restarts where the trainer asks, producer failures raised in the trainer.

The producer's capture here is the in-process `TargetCapture` of a tiny target (the engine's
`VllmCapture` has the same interface; tests/engine run the source with a real vLLM engine)."""

from __future__ import annotations

import threading

import pytest
import torch

from peagle.data.packing import pack_documents
from peagle.errors import EngineError
from peagle.target.capture import TargetCapture
from peagle.target.sources import OfflineFeatureSource, write_feature_shards
from peagle.target.streaming import StreamingFeatureSource


class Counting:
    """A `TargetCapture` that records how far the producer got (and can be told to fail)."""

    def __init__(self, inner: TargetCapture, fail_at: int | None = None) -> None:
        self.inner, self.calls, self.fail_at = inner, 0, fail_at
        self.head_weight, self.head_bias = inner.head_weight, inner.head_bias
        self.gate = threading.Event()
        self.gate.set()

    def hidden(self, input_ids, document_ids):
        self.gate.wait()
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise EngineError("capture engine exited with code 1")
        return self.inner.hidden(input_ids, document_ids)


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


def test_same_batches_as_offline_and_files_deleted(tiny_model, rows, tmp_path):
    cap = TargetCapture(tiny_model, "auto", torch.arange(0, 4000, 7))
    write_feature_shards(cap, rows, tmp_path / "off", rows_per_shard=3, aux_dtype=torch.float32)
    off = OfflineFeatureSource(tmp_path / "off", micro_batch_size=2, seed=5)
    nb = off.num_batches()
    src = StreamingFeatureSource(Counting(cap), rows, 2, 5, out_dir=tmp_path / "stream",
                                 total_micro_batches=2 * nb, disk_budget_bytes=1e12, max_ahead=3)
    try:
        for epoch in range(2):
            for index in range(nb):
                _equal(src.batch(epoch, index), off.batch(epoch, index))
                j = epoch * nb + index
                left = sorted(int(f.stem.split("_")[1]) for f in (tmp_path / "stream").glob("mb_*"))
                assert all(j < x <= j + 3 for x in left), (j, left)  # consumed deleted, at most max_ahead
    finally:
        src.close()
    assert not (tmp_path / "stream").exists()


def test_disk_budget_holds_the_producer_back(tiny_model, rows, tmp_path):
    cap = Counting(TargetCapture(tiny_model, "auto", None))
    src = StreamingFeatureSource(cap, rows, 2, 0, out_dir=tmp_path / "s", total_micro_batches=5,
                                 disk_budget_bytes=1.0, max_ahead=10)
    try:
        src.batch(0, 0)
        deadline = threading.Event()
        deadline.wait(1.5)  # the producer had time to run ahead if it were allowed to
        files = list((tmp_path / "s").glob("mb_*"))
        assert len(files) == 1  # one ahead always allowed, no more over a budget of 1 byte
        assert cap.calls == 2
        src.batch(0, 1)
        src.batch(0, 2)
    finally:
        src.close()


def test_resume_restarts_the_producer_where_the_trainer_is(tiny_model, rows, tmp_path):
    cap = TargetCapture(tiny_model, "auto", None)
    write_feature_shards(cap, rows, tmp_path / "off", rows_per_shard=4, aux_dtype=torch.float32)
    off = OfflineFeatureSource(tmp_path / "off", micro_batch_size=1, seed=0)
    counting = Counting(cap)
    src = StreamingFeatureSource(counting, rows, 1, 0, out_dir=tmp_path / "s", total_micro_batches=len(rows),
                                 disk_budget_bytes=1e12, max_ahead=2)
    try:
        _equal(src.batch(0, 4), off.batch(0, 4))  # a resumed run starts in the middle
        assert counting.calls <= 1 + 2 + 1
        _equal(src.batch(0, 1), off.batch(0, 1))  # going back restarts there
        _equal(src.batch(0, 2), off.batch(0, 2))
    finally:
        src.close()


def test_a_failing_engine_fails_the_trainer(tiny_model, rows, tmp_path):
    src = StreamingFeatureSource(Counting(TargetCapture(tiny_model, "auto", None), fail_at=2), rows, 1, 0,
                                 out_dir=tmp_path / "s", total_micro_batches=len(rows), disk_budget_bytes=1e12,
                                 max_ahead=4)
    try:
        src.batch(0, 0)
        src.batch(0, 1)
        with pytest.raises(EngineError, match="exited with code 1"):
            src.batch(0, 2)
    finally:
        src.close()
