"""Regeneration with transformers' `generate` (tiny random Llama): the same rules and cache as vLLM."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.data.regenerate import RegenSettings, regenerate_conversations
from peagle.data.regenerate_cache import REGEN_CACHE_ENV
from peagle.data.regenerate_engines import HfBackend, TurnRequest
from peagle.spec.funnel import NO_ASSISTANT_TURN, REGEN_ANSWER_CUT

IDENTITY = {"builtin": "builtin:tiny-llama"}
CONVS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"},
     {"role": "user", "content": "More"}, {"role": "assistant", "content": "old2"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "old"}],
    [{"role": "user", "content": "Z"}, {"role": "assistant", "content": "old"}],
    [{"role": "user", "content": "no answer here"}],
]


class Counting:
    """The model, counting `generate` calls and keeping the prompts they got (decoded, padding removed)."""

    def __init__(self, model, tok) -> None:
        self.model, self.tok, self.calls, self.prompts = model, tok, 0, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, **kw):
        self.calls += 1
        for ids, mask in zip(kw["input_ids"], kw["attention_mask"], strict=True):
            self.prompts.append(self.tok.decode(ids[mask.bool()].tolist()))
        return self.model.generate(**kw)


def _settings(**kw) -> RegenSettings:
    base = {"engine": "hf", "dtype": "float32", "temperature": 0.0, "max_new_tokens": 12, "on_length": "keep",
            "batch_size": 2, "max_length": 128, "max_model_len": 140, "seed": 0}
    return RegenSettings(**{**base, **kw})


def _run(model, tok, convs, settings, cache):
    return regenerate_conversations(convs, tok, settings, identity=IDENTITY, cache_dir=cache,
                                    open_backend=lambda: _Open(HfBackend(model, tok)))


class _Open:
    opened = 0

    def __init__(self, backend) -> None:
        self.backend = backend

    def __enter__(self):
        _Open.opened += 1
        return self.backend

    def __exit__(self, *exc) -> None:
        pass


def test_hf_follows_the_rules_and_resumes_from_the_cache(tiny_model, smollm2_tokenizer, tmp_path):
    # sampled: the random model's greedy answers are only newlines (dropped as no answer, tested below)
    s = _settings(temperature=1.0)
    m = Counting(tiny_model, smollm2_tokenizer)
    res = _run(m, smollm2_tokenizer, CONVS, s, tmp_path)
    assert m.calls == 5  # one per answer when sampling (2 + 1 + 1, + 1 for the prompt without an answer)
    assert res.reasons == {}
    # the prompt without an answer gets the target's (appended), asked with the generation prompt
    (alone,) = [p for p in m.prompts if "no answer here" in p]
    assert alone.endswith("no answer here<|im_end|>\n<|im_start|>assistant\n")
    assert [t["role"] for t in res.conversations[3] or []] == ["user", "assistant"]
    for new, old in zip(res.conversations[:3], CONVS, strict=False):
        assert new is not None and [t["role"] for t in new] == [t["role"] for t in old]
        assert [t["content"] for t in new if t["role"] != "assistant"] == [
            t["content"] for t in old if t["role"] != "assistant"]
    # multi-turn: the second turn's prompt holds the regenerated first answer
    first = res.conversations[0][1]["content"]  # type: ignore[index]
    (p2,) = [p for p in m.prompts if "More" in p]
    assert first and first in p2 and "old" not in p2
    # a random 12-token answer never reaches the end of turn: every answer is cut; `keep` counts them
    assert res.report["answers_cut"] == 4
    # `drop` reuses the same records and drops them (no generate call)
    m_drop = Counting(tiny_model, smollm2_tokenizer)
    dropped = _run(m_drop, smollm2_tokenizer, CONVS, _settings(temperature=1.0, on_length="drop"), tmp_path)
    assert m_drop.calls == 0 and dropped.reasons == dict.fromkeys(range(4), REGEN_ANSWER_CUT)
    # interrupted after the first record: only the missing conversations are generated again
    (cache,) = tmp_path.glob("*.jsonl")
    cache.write_text(cache.read_text().splitlines(keepends=True)[0])
    m2 = Counting(tiny_model, smollm2_tokenizer)
    again = _run(m2, smollm2_tokenizer, CONVS, s, tmp_path)
    assert again.report["cached"] == 1 and again.report["generated"] == 3
    assert again.conversations == res.conversations  # every turn sampled under its own seed: identical
    # greedy: the random model answers newlines only, and a conversation without a non-empty answer is dropped
    greedy = _run(tiny_model, smollm2_tokenizer, CONVS, _settings(), tmp_path)
    assert greedy.reasons == dict.fromkeys(range(4), NO_ASSISTANT_TURN)
    assert greedy.report["generated"] == 4


def test_hf_finish_reasons_and_token_counts(tiny_model, smollm2_tokenizer):
    backend = HfBackend(tiny_model, smollm2_tokenizer)
    eos = backend.eos[0]
    ids = smollm2_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    reqs = [TurnRequest(ids["input_ids"], 3, 0.0, 0), TurnRequest(ids["input_ids"][2:], 5, 0.0, 0)]
    out = backend.generate(reqs)
    assert [r.finish_reason for r in out] == ["length", "length"] and [r.num_tokens for r in out] == [3, 5]
    # a model that ends its turn at once: `stop`, the end-of-turn token counted but not in the text

    class Ends:
        generation_config = tiny_model.generation_config
        training = False

        def parameters(self):
            return tiny_model.parameters()

        def eval(self):
            return self

        def train(self, mode=True):
            return self

        def generate(self, input_ids, **kw):
            tail = torch.tensor([[42, eos, 7]] * input_ids.shape[0])
            return torch.cat([input_ids, tail], dim=1)

    ended = HfBackend(Ends(), smollm2_tokenizer).generate(reqs)
    assert [(r.finish_reason, r.num_tokens) for r in ended] == [("stop", 2), ("stop", 2)]
    assert ended[0].text == smollm2_tokenizer.decode([42])


def test_hf_sampling_does_not_depend_on_batch_order(tiny_model, smollm2_tokenizer, tmp_path):
    s = _settings(temperature=1.0, batch_size=3)
    a = _run(tiny_model, smollm2_tokenizer, CONVS, s, tmp_path / "a")
    b = _run(tiny_model, smollm2_tokenizer, CONVS[::-1], RegenSettings(**{**s.__dict__, "batch_size": 1}), tmp_path / "b")
    assert a.conversations == b.conversations[::-1]
    c = _run(tiny_model, smollm2_tokenizer, CONVS, RegenSettings(**{**s.__dict__, "seed": 1}), tmp_path / "c")
    assert c.conversations != a.conversations  # another seed samples other answers
    assert torch.rand(1).item() != torch.rand(1).item()  # (the global generator was left alone, and works)


def test_prepare_data_regenerates_with_transformers(tiny_model, smollm2_tokenizer, tmp_path, monkeypatch):
    from peagle.data.prepare import prepare_data
    from peagle.spec import parse_spec

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS[:3] * 2))
    spec = parse_spec({
        "target": {"model": "builtin:tiny-llama"},
        "data": {"sources": [{"path": str(data)}], "max_length": 64,
                 "regenerate": {"enabled": True, "engine": "hf", "max_new_tokens": 3, "on_length": "keep",
                                "temperature": 1.0}},
        "draft": {"draft_vocab_size": 64}, "optim": {"pack_length": 128},
    })
    monkeypatch.setenv(REGEN_CACHE_ENV, str(tmp_path / "shared"))
    m = Counting(tiny_model, smollm2_tokenizer)
    pd = prepare_data(spec, smollm2_tokenizer, tmp_path / "run", target_vocab_size=49152, workers=1, model=m)
    reg = pd.report["regeneration"]
    assert (reg["engine"], reg["conversations"], reg["generated"], reg["answers_cut"]) == ("hf", 6, 3, 6)
    assert pd.report["funnel"]["kept"] == 6 and m.calls == 4  # 3 distinct conversations, 4 answers
    m2 = Counting(tiny_model, smollm2_tokenizer)
    again = prepare_data(spec, smollm2_tokenizer, tmp_path / "run2", target_vocab_size=49152, workers=1, model=m2)
    assert m2.calls == 0 and torch.equal(again.train.input_ids, pd.train.input_ids)
    with pytest.raises(Exception, match="needs the target model"):
        prepare_data(spec, smollm2_tokenizer, tmp_path / "run3", target_vocab_size=49152, workers=1)


def test_an_answer_cut_at_max_length_leaves_the_training_row_of_a_full_answer(tiny_model, smollm2_tokenizer,
                                                                               tmp_path, monkeypatch):
    """Answers are generated only as far as training keeps them (`data.max_length` + `LENGTH_MARGIN`): the
    rows are the same as those of answers generated to their end (the same settings, so the same sampling
    seeds, with the clamp lifted). Sampled: the random model's tokens are far from canonical, so their text
    tokenises differently the second time (mostly into more tokens; the test beside the driver's covers
    fewer)."""
    import peagle.data.regenerate as regen
    from peagle.data.template import tokenize_conversation

    convs = [[{"role": "user", "content": f"question {k}"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "old"}] for k in range(4)]
    max_length = 40
    s = _settings(temperature=1.0, max_new_tokens=48, batch_size=1, max_length=max_length, max_model_len=200)
    m = Counting(tiny_model, smollm2_tokenizer)
    cut = _run(m, smollm2_tokenizer, convs, s, tmp_path / "a")
    monkeypatch.setattr(regen, "LENGTH_MARGIN", 10**6)  # the clamp lifted: answers run to max_new_tokens
    full = _run(tiny_model, smollm2_tokenizer, convs, s, tmp_path / "b")
    assert cut.report["stopped_at_max_length"] == 4 and cut.report["answers_cut"] == 0
    assert full.report["answers_cut"] == 4  # 48 random tokens never end the turn
    assert m.calls == 4  # the second turns would be cut away: never asked
    assert cut.report["tokens"] < full.report["tokens"]
    for a, b in zip(cut.conversations, full.conversations, strict=True):
        assert a is not None and b is not None and len(a) == 2 and len(b) == 3 and a[1] != b[1]
        ra = tokenize_conversation(smollm2_tokenizer, a, max_length=max_length)
        rb = tokenize_conversation(smollm2_tokenizer, b, max_length=max_length)
        assert ra.truncated and (ra.input_ids, ra.loss_mask) == (rb.input_ids, rb.loss_mask)
