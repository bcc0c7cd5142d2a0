"""Features captured by a real vLLM engine equal the transformers capture, and train the same (slow).

One fp32 and one bf16 SmolLM2 engine (about 40 s to start each), shared by the tests of this module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle.data.packing import pack_documents, shift_features
from peagle.engine.locate import vllm_python
from peagle.engine.server import CaptureOptions, EngineConfig, VllmServer
from peagle.target.capture import TargetCapture
from peagle.target.parts import load_target_parts
from peagle.target.sources import OfflineFeatureSource, write_feature_shards
from peagle.target.vllm_capture import VllmCapture, document_spans

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
AUX = [2, 15, 27]


def require_vllm() -> None:
    if vllm_python() is None:
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")


@pytest.fixture(scope="module")
def rows(smollm2_path):
    """Packed rows of real templated ShareGPT conversations: several documents per row and padding."""
    from transformers import AutoTokenizer

    from peagle.builtin import sharegpt_path
    from peagle.data.formats import IngestReport, iter_rows
    from peagle.data.template import tokenize_many

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    convs = [r.messages for r in iter_rows(sharegpt_path(), "sharegpt", IngestReport(), max_samples=12)]
    enc = tokenize_many(tok, convs, max_length=200, think="keep", workers=1)
    docs = [(e.input_ids, e.loss_mask) for e in enc if sum(e.loss_mask) > 0]
    packed = pack_documents(docs, 384, seed=0)
    assert any(len(document_spans(packed.document_ids[r])) > 1 for r in range(len(packed)))
    assert bool((packed.document_ids < 0).any())
    return packed


def _engine(smollm2_path: Path, dtype: str, tmp: Path) -> VllmServer:
    cfg = EngineConfig(model=str(smollm2_path), dtype=dtype, max_model_len=512,
                       capture=CaptureOptions(layer_ids=(*AUX, 30), storage_dir=tmp / "hs"))
    return VllmServer(cfg, log_path=tmp / "engine.log", name=f"capture engine ({dtype})")


@pytest.fixture(scope="module")
def fp32_features(smollm2_path, rows, tmp_path_factory):
    """(vLLM aux, vLLM final, vLLM shards dir) in fp32, and the engine's capture object."""
    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-fp32")
    parts = load_target_parts(smollm2_path, dtype=torch.float32)
    with _engine(smollm2_path, "float32", tmp) as server:
        cap = VllmCapture(server, parts, AUX)
        aux, final = cap.hidden(rows.input_ids, rows.document_ids)
        write_feature_shards(cap, rows, tmp / "shards", rows_per_shard=2, aux_dtype=torch.float32)
    assert not list((tmp / "hs").iterdir()), "the engine's per-request files are removed once read"
    return aux, final, tmp / "shards", cap


@pytest.fixture(scope="module")
def hf_fp32(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_fp32_aux_and_final_equal_transformers(fp32_features, hf_fp32, rows):
    aux, final, _, cap = fp32_features
    ref_aux, ref_final = TargetCapture(hf_fp32, AUX).hidden(rows.input_ids, rows.document_ids)
    real = rows.document_ids >= 0
    assert aux.dtype == torch.float32 and aux.shape == ref_aux.shape
    assert _rel(aux[real], ref_aux[real]) <= 1e-5
    assert _rel(final[real], ref_final[real]) <= 1e-5
    assert cap.documents_captured == sum(len(document_spans(d)) for d in rows.document_ids) * 2  # hidden + shards


def test_shards_from_the_engine_train_like_the_in_process_capture(fp32_features, hf_fp32, rows, tmp_path):
    """The offline source over vLLM-written shards gives the batch, and one training step the loss, of the
    transformers capture (rtol 1e-4)."""
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target
    from peagle.train.step import DraftObjective, StepSettings, plan_rows, run_micro_batch

    *_, shards, _ = fp32_features
    src = OfflineFeatureSource(shards, micro_batch_size=2, seed=0)
    vb = src.batch(0, 0)
    order = src._indices(0, 0)
    part = rows.select(order)
    ref_aux, ref_logits = TargetCapture(hf_fp32, AUX).capture(part.input_ids, part.document_ids)
    hb = shift_features(part.input_ids, part.loss_mask, part.document_ids, ref_aux, ref_logits)
    assert torch.equal(vb["input_ids"], hb["input_ids"]) and torch.equal(vb["loss_mask"], hb["loss_mask"])
    sup = hb["loss_mask"] > 0
    assert _rel(vb["target_logits"][sup], hb["target_logits"][sup]) <= 1e-5

    cfg = DraftConfig.from_target(hf_fp32.config, num_layers=1, draft_vocab_size=hf_fp32.config.vocab_size,
                                  mask_token_id=49151, aux_layer_ids=AUX)
    settings = StepSettings(num_depths=3, down_sample_ratio=0.8, down_sample_ratio_min=0.3, max_anchors=None,
                            sequence_partitions=1, mask_token_id=49151, attention="sdpa", autocast_dtype=None,
                            seed=7)

    def loss(batch):
        torch.manual_seed(0)
        draft = PEagleDraft(cfg)
        init_from_target(draft, hf_fp32, None)
        objective = DraftObjective(draft, settings.num_depths, None)
        planned = plan_rows(batch, settings, epoch=0, index=0, row_ids=list(range(batch["input_ids"].shape[0])))
        m = run_micro_batch(objective, draft, batch, planned, settings, scale=1.0)
        return float(m.loss_sum)

    assert loss(vb) == pytest.approx(loss(hb), rel=1e-4)


def test_bf16_capture_is_within_bf16_rounding(smollm2_path, rows, tmp_path_factory, hf_fp32):
    """bf16 engine vs transformers bf16: their difference is of the size of bf16's own rounding (each is as
    far from the fp32 states as the other), not a wrong layer or position."""
    from transformers import AutoModelForCausalLM

    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-bf16")
    parts = load_target_parts(smollm2_path, dtype=torch.bfloat16)
    with _engine(smollm2_path, "bfloat16", tmp) as server:
        aux, final = VllmCapture(server, parts, AUX).hidden(rows.input_ids, rows.document_ids)
    hf16 = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.bfloat16).eval()
    ref_aux, ref_final = TargetCapture(hf16, AUX).hidden(rows.input_ids, rows.document_ids)
    f32_aux, f32_final = TargetCapture(hf_fp32, AUX).hidden(rows.input_ids, rows.document_ids)
    real = rows.document_ids >= 0
    assert aux.dtype == torch.bfloat16
    for got, ref, exact in ((aux, ref_aux, f32_aux), (final, ref_final, f32_final)):
        rounding = _rel(ref[real], exact[real])  # how far bf16 transformers is from fp32
        assert 0 < rounding < 0.1
        assert _rel(got[real], exact[real]) <= 2 * rounding
        assert _rel(got[real], ref[real]) <= 2 * rounding
