"""Target capture: exact aux layers, restricted logits, document isolation; online == offline sources."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.data.packing import PackedRows, pack_documents
from peagle.errors import DataInvalidError, TargetLoadError
from peagle.target.capture import (
    TargetCapture,
    block_causal_mask,
    document_position_ids,
    resolve_aux_layer_ids,
)
from peagle.target.sources import OfflineFeatureSource, OnlineFeatureSource, write_feature_shards


def test_resolve_aux_layer_ids():
    assert resolve_aux_layer_ids("auto", 30) == [2, 15, 27]
    assert resolve_aux_layer_ids("auto", 36) == [2, 18, 33]
    assert resolve_aux_layer_ids("auto", 4) == [1, 2, 3]  # too shallow for distinct defaults
    assert resolve_aux_layer_ids([0, 1, 3], 4) == [0, 1, 3]
    with pytest.raises(TargetLoadError, match="outside"):
        resolve_aux_layer_ids([1, 2, 4], 4)
    with pytest.raises(TargetLoadError, match="distinct"):
        resolve_aux_layer_ids([1, 1, 2], 4)


def test_positions_and_mask():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1]])
    assert document_position_ids(doc).tolist() == [[0, 1, 0, 1, 2, 0]]
    m = block_causal_mask(doc, torch.float32)[0, 0] == 0
    assert m[3].tolist() == [False, False, True, True, False, False]
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert m[5].tolist() == [False] * 5 + [True]  # padding sees only itself


def _reference(model, ids, ids_layers):
    out = model(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in ids_layers], dim=-1)
    return aux, out.logits


def test_capture_equals_hidden_states_exactly(tiny_model):
    sel = torch.tensor([0, 5, 17, 300, 49151])
    cap = TargetCapture(tiny_model, [0, 2, 3], sel)
    ids = torch.randint(20, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    aux, logits = cap.capture(ids, torch.zeros_like(ids))
    ref_aux, ref_logits = _reference(tiny_model, ids, (0, 2, 3))
    assert aux.shape == (2, 12, 3 * 64) and aux.dtype == torch.float32
    assert torch.equal(aux, ref_aux)  # exact: vLLM "input of layer i" == hidden_states[i]
    assert logits.shape == (2, 12, 5) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits[..., sel], rtol=1e-5, atol=1e-5)
    # packed path (explicit block-causal mask + per-document positions): exact against the same inputs
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 10 + [-1] * 2])
    aux, logits = cap.capture(ids, doc)
    out = tiny_model(
        input_ids=ids,
        attention_mask=block_causal_mask(doc, torch.float32),
        position_ids=document_position_ids(doc),
        output_hidden_states=True,
    )
    assert torch.equal(aux, torch.cat([out.hidden_states[i] for i in (0, 2, 3)], dim=-1))
    torch.testing.assert_close(logits, out.logits[..., sel], rtol=1e-5, atol=1e-5)


def test_packed_documents_do_not_see_each_other(tiny_model):
    g = torch.Generator().manual_seed(1)
    docs = [(torch.randint(20, 5000, (n,), generator=g).tolist(), [1] * n) for n in (7, 11, 5)]
    rows = pack_documents(docs, 32, seed=0)
    assert len(rows) == 1
    cap = TargetCapture(tiny_model, "auto", None)
    aux, logits = cap.capture(rows.input_ids, rows.document_ids)
    for d in range(3):
        sel = rows.document_ids[0] == d
        alone_ids = rows.input_ids[0][sel][None]
        a_aux, a_logits = cap.capture(alone_ids, torch.zeros_like(alone_ids))
        torch.testing.assert_close(aux[0][sel], a_aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[0][sel], a_logits[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(aux).all() and torch.isfinite(logits).all()  # padding rows: no NaN


def test_smollm2_capture_equals_hidden_states(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    cap = TargetCapture(model, "auto", torch.arange(0, 49152, 7))
    assert cap.aux_layer_ids == [2, 15, 27]
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]])
    aux, logits = cap.capture(ids, torch.zeros_like(ids))
    out = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(aux, torch.cat([out.hidden_states[i] for i in (2, 15, 27)], dim=-1))
    torch.testing.assert_close(logits, out.logits[..., ::7], rtol=1e-4, atol=1e-4)


def _rows():
    g = torch.Generator().manual_seed(2)
    docs = [
        (torch.randint(20, 5000, (n,), generator=g).tolist(), [0, 1] * (n // 2) + [1] * (n % 2))
        for n in (9, 14, 5, 20, 8, 12, 3, 17)
    ]
    return pack_documents(docs, 24, seed=0)


def test_offline_equals_online_and_resumes(tiny_model, tmp_path):
    rows = _rows()
    cap = TargetCapture(tiny_model, "auto", torch.arange(100, 400))
    out = tmp_path / "feat"
    man = write_feature_shards(cap, rows, out, rows_per_shard=2, batch_size=1, aux_dtype=torch.float32)
    assert man["complete"] and man["num_rows"] == len(rows) and len(man["shards"]) == (len(rows) + 1) // 2
    online = OnlineFeatureSource(cap, rows, micro_batch_size=2, seed=5)
    offline = OfflineFeatureSource(out, micro_batch_size=2, seed=5)
    assert online.num_batches() == offline.num_batches() == (len(rows) + 1) // 2
    for epoch in (0, 1):
        for i in range(online.num_batches()):
            a, b = online.batch(epoch, i), offline.batch(epoch, i)
            assert set(a) == {"input_ids", "loss_mask", "document_ids", "aux", "target_logits"}
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
            assert a["aux"].shape[-1] == 3 * 64 and a["target_logits"].shape[-1] == 300
    part = offline.batch_rows(1, 0, [1])
    whole = online.batch(1, 0)
    for k in whole:
        torch.testing.assert_close(part[k], whole[k][1:2], rtol=1e-5, atol=1e-5)
    # epochs shuffle differently, but deterministically
    first = [online.batch(0, i)["input_ids"] for i in range(online.num_batches())]
    again = [
        OnlineFeatureSource(cap, rows, 2, 5).batch(0, i)["input_ids"] for i in range(online.num_batches())
    ]
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))

    # interrupted capture: drop the last shard + mark incomplete; resume rewrites only that shard
    mpath = out / "manifest.json"
    m = json.loads(mpath.read_text())
    last = m["shards"].pop()
    m["complete"] = False
    mpath.write_text(json.dumps(m))
    (out / last["file"]).unlink()
    before = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in m["shards"]}
    with pytest.raises(DataInvalidError, match="incomplete"):
        OfflineFeatureSource(out, 2, 5)
    man2 = write_feature_shards(cap, rows, out, rows_per_shard=2, batch_size=1, aux_dtype=torch.float32)
    assert man2["complete"] and (out / last["file"]).exists()
    assert {f: (out / f).stat().st_mtime_ns for f in before} == before  # finished shards untouched
    with pytest.raises(DataInvalidError, match="other rows"):
        write_feature_shards(
            cap, PackedRows(rows.input_ids[:2], rows.loss_mask[:2], rows.document_ids[:2]), out
        )


def test_bf16_aux_storage(tiny_model, tmp_path):
    rows = _rows()
    cap = TargetCapture(tiny_model, "auto", None)
    write_feature_shards(cap, rows, tmp_path / "f", rows_per_shard=4)
    b = OfflineFeatureSource(tmp_path / "f", 3, 0).batch(0, 0)
    a = OnlineFeatureSource(cap, rows, 3, 0).batch(0, 0)
    assert b["aux"].dtype == torch.bfloat16  # as stored: no fp32 copy of bf16 values in the batch
    assert a["aux"].dtype == torch.float32  # the fp32 target's own states
    assert torch.equal(b["aux"], a["aux"].to(torch.bfloat16))
    torch.testing.assert_close(a["target_logits"], b["target_logits"], rtol=1e-5, atol=1e-5)


def test_bf16_target_features_stay_bf16(tiny_model):
    """A bf16 target's aux states and logits are returned as computed (half the memory of fp32 copies)."""
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    sel = torch.arange(100, 400)
    cap = TargetCapture(model, [0, 2, 3], sel)
    ids = torch.randint(20, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    aux, logits = cap.capture(ids, torch.zeros_like(ids))
    assert aux.dtype == logits.dtype == torch.bfloat16
    out = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(aux, torch.cat([out.hidden_states[i] for i in (0, 2, 3)], dim=-1))
    torch.testing.assert_close(logits, out.logits[..., sel], rtol=0, atol=0)
    batch = OnlineFeatureSource(cap, _rows(), micro_batch_size=2, seed=0).batch(0, 0)
    assert batch["aux"].dtype == batch["target_logits"].dtype == torch.bfloat16
