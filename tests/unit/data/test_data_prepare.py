"""prepare_data end to end (real ShareGPT + SmolLM2 tokenizer); regeneration: test_regenerate*.py."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.data.prepare import prepare_data
from peagle.data.vocab import load_vocab
from peagle.errors import DataInvalidError
from peagle.spec import parse_spec


def _spec(**data):
    base = {
        "target": {"model": "builtin:tiny-llama"},
        "data": {
            "sources": [{"path": "builtin:sharegpt", "max_samples": 30}],
            "max_length": 256,
            "eval_samples": 4,
            **data,
        },
        "draft": {"draft_vocab_size": 512},
        "optim": {"pack_length": 512, "seed": 1},
    }
    return parse_spec(base)


def test_prepare_real_sharegpt(smollm2_tokenizer, tmp_path):
    spec = _spec()
    pd = prepare_data(spec, smollm2_tokenizer, tmp_path, target_vocab_size=49152, workers=1)
    rep = pd.report
    assert rep["rows_kept"] == rep["train_conversations"] + rep["eval_conversations"]
    assert rep["eval_conversations"] == 4 and pd.eval.num_documents() == 4
    assert pd.train.num_documents() == rep["train_conversations"]
    assert rep["rows_read"] == rep["rows_kept"] + rep["rows_skipped"]
    assert pd.train.input_ids.shape[1] == 512
    assert pd.draft_vocab_size == 512 and pd.vocab.t2d.shape == (49152,)
    v = load_vocab(tmp_path / "data" / "vocab.safetensors")
    assert torch.equal(v.d2t, pd.vocab.d2t)
    # the mask token never occurs in the data
    assert (
        not (pd.train.input_ids == pd.mask_token_id).any()
        and not (pd.eval.input_ids == pd.mask_token_id).any()
    )
    # every assistant token of the train rows is counted; the im_end token is in the draft vocab
    assert pd.vocab.t2d[smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert json.loads((tmp_path / "data" / "report.json").read_text())["mask_token_id"] == pd.mask_token_id
    # second call reloads (same spec hash)
    again = prepare_data(spec, smollm2_tokenizer, tmp_path, target_vocab_size=49152, workers=1)
    assert torch.equal(again.train.input_ids, pd.train.input_ids) and again.mask_token_id == pd.mask_token_id


def test_prepare_reports_zero_assistant_rows_and_fails_on_nothing(smollm2_tokenizer, tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
        {"conversations": []},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _spec(sources=[{"path": str(p), "format": "messages"}], eval_samples=0, max_length=64)
    pd = prepare_data(spec, smollm2_tokenizer, tmp_path / "run", target_vocab_size=49152, workers=1)
    assert pd.report["train_conversations"] == 1
    assert pd.report["skipped_by_reason"] == {"missing_field": 1, "too_long_no_assistant_left": 1}
    assert {b["line"] for b in pd.report["bad_rows"]} == {1, 3}
    p.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataInvalidError, match="no training conversation"):
        prepare_data(spec, smollm2_tokenizer, tmp_path / "run2", target_vocab_size=49152, workers=1)


def test_prepare_explicit_mask_token_in_data_fails(smollm2_tokenizer, tmp_path):
    spec = _spec()
    spec.draft.mask_token_id = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(DataInvalidError, match="occurs in the training data"):
        prepare_data(spec, smollm2_tokenizer, tmp_path, target_vocab_size=49152, workers=1)
