"""The parallel-drafting reference decoder: output == plain greedy decoding; acceptance counted right."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.data.prompts import load_prompts, tokenize_prompts
from peagle.errors import DataInvalidError
from peagle.eval.reference import (
    DecodeResult,
    DraftProposer,
    evaluate_prompts,
    greedy_decode,
    speculative_decode,
    summarize,
)

V, H, N = 256, 64, 4
PROMPT = [5, 17, 33, 99, 100, 7]


@pytest.fixture(scope="module")
def target():
    from peagle.builtin import build_tiny_llama

    return build_tiny_llama(vocab_size=V, hidden_size=H, num_layers=N, seed=3)


@pytest.fixture(scope="module")
def draft(target):
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    cfg = DraftConfig.from_target(target.config, num_layers=2, draft_vocab_size=64, mask_token_id=V - 1,
                                  aux_layer_ids=[1, 2, 3])  # fmt: skip
    torch.manual_seed(0)
    d = PEagleDraft(cfg)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(2))[:64]] = True
    init_from_target(d, target, t2d)
    return d.eval()


@pytest.fixture(scope="module")
def greedy(target):
    return greedy_decode(target, PROMPT, max_new_tokens=40)


def test_plain_greedy_matches_hf_generate(target, greedy):
    out = target.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    assert greedy == out[0, len(PROMPT) :].tolist()


def test_untrained_draft_output_is_plain_greedy(target, draft, greedy):
    r = speculative_decode(target, DraftProposer(draft, 3), PROMPT, aux_layer_ids=[1, 2, 3],
                           num_speculative_tokens=3, max_new_tokens=40)  # fmt: skip
    assert r.tokens == greedy
    # one verification per committed group: 1 prefill token + sum(accepted + 1) >= 40
    assert 1 + sum(n + 1 for n in r.accepted) >= 40
    assert all(0 <= n <= 3 for n in r.accepted)


def _force(draft, greedy, n_right: int):
    """Hooks that make the draft predict the target's greedy continuation at its first `n_right` positions."""
    vocab = draft.t2d.nonzero().flatten()  # draft index -> target id (d2t offsets applied)
    state = {}

    def pre_hook(module, args):
        state["m"] = int((~args[2]).sum())  # real slots = len(seq) - 1

    def logits_hook(module, args, output):
        m = state["m"]
        gen_len = m + 1 - len(PROMPT)  # tokens already generated (incl. the bonus token)
        out = torch.full_like(output, -1e4)
        for k in range(output.shape[0]):
            want = greedy[gen_len + k] if gen_len + k < len(greedy) else -1
            if k < n_right and want in vocab.tolist():
                out[k, vocab.tolist().index(want)] = 1.0
            else:
                wrong = next(i for i, t in enumerate(vocab.tolist()) if t != want)
                out[k, wrong] = 1.0
        return out

    return [draft.register_forward_pre_hook(pre_hook), draft.lm_head.register_forward_hook(logits_hook)]


def test_forced_draft_is_accepted_and_output_unchanged(target, greedy):
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    cfg = DraftConfig.from_target(target.config, num_layers=1, draft_vocab_size=None, mask_token_id=V - 1,
                                  aux_layer_ids=[1, 2, 3])  # fmt: skip
    d = PEagleDraft(cfg)
    init_from_target(d, target, None)
    d.d2t, d.t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)  # identity mapping, for the hook
    d.eval()
    handles = _force(d, greedy, n_right=2)
    try:
        r = speculative_decode(target, DraftProposer(d, 4), PROMPT, aux_layer_ids=[1, 2, 3],
                               num_speculative_tokens=4, max_new_tokens=40)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    assert r.tokens == greedy
    assert set(r.accepted) == {2}  # exactly the two forced positions every time
    rep = summarize([r], 4)
    assert rep.acceptance_length == pytest.approx(3.0)
    assert rep.per_position == [1.0, 1.0, 0.0, 0.0]
    handles = _force(d, greedy, n_right=4)
    try:
        r = speculative_decode(target, DraftProposer(d, 4), PROMPT, aux_layer_ids=[1, 2, 3],
                               num_speculative_tokens=4, max_new_tokens=40)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    assert r.tokens == greedy
    assert r.accepted[:-1] == [4] * (len(r.accepted) - 1)


def test_eos_stops_like_generate(target, draft, greedy):
    eos = greedy[10]
    want = target.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)[0, len(PROMPT) :].tolist()  # fmt: skip
    r = speculative_decode(target, DraftProposer(draft, 3), PROMPT, aux_layer_ids=[1, 2, 3],
                           num_speculative_tokens=3, max_new_tokens=40, eos_token_ids=[eos])  # fmt: skip
    assert r.tokens == want and r.tokens[-1] == eos


def test_summarize_counts_al_and_positions():
    rep = summarize([DecodeResult(tokens=[1, 2, 3], accepted=[0, 2, 3]), DecodeResult(tokens=[4], accepted=[1])], 3)
    assert rep.acceptance_length == pytest.approx(1 + 6 / 4)
    assert rep.per_position == [0.75, 0.5, 0.25]
    assert rep.num_drafts == 4 and rep.tokens_generated == 4 and rep.num_prompts == 2


def test_evaluate_prompts_reports(target, draft):
    rep = evaluate_prompts(target, draft, [PROMPT, PROMPT[:3]], num_speculative_tokens=3, max_new_tokens=12)
    d = rep.to_dict()
    assert set(d) >= {"acceptance_length", "per_position", "tokens_generated", "num_drafts"}
    assert d["tokens_generated"] == 24 and len(d["per_position"]) == 3 and "outputs" not in d


def test_load_prompts_sets_and_jsonl(tmp_path):
    he = load_prompts("humaneval", 3)
    assert len(he) == 3 and he[0].lstrip().startswith("from typing import List")
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "yo"}]}) + "\n")
    assert load_prompts(str(f), 10) == ["hi", "yo"]
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(DataInvalidError, match=r"p.jsonl:2: needs a non-empty string 'prompt'"):
        load_prompts(str(f), 10)
    with pytest.raises(DataInvalidError, match="not 'humaneval'"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_prompts_go_through_the_chat_template(smollm2_tokenizer):
    ids = tokenize_prompts(smollm2_tokenizer, ["def f():"])[0]
    text = smollm2_tokenizer.decode(ids)
    assert "<|im_start|>user\ndef f():<|im_end|>" in text and text.rstrip().endswith("<|im_start|>assistant")


def test_cached_proposer_equals_full_recompute(target, draft):
    """The draft KV cache gives the same logits (hence proposals) as recomputing every slot, step by step."""
    from peagle.eval.reference import CachedDraftProposer

    full, cached = DraftProposer(draft, 3), CachedDraftProposer(draft, 3)
    seen: list[torch.Tensor] = []
    handle = draft.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    calls = {"n": 0}

    def both(seq, aux):
        calls["n"] += 1
        want, got = full(seq, aux), cached(seq, aux)
        want_logits, got_logits = seen[-2], seen[-1]
        assert got_logits.shape == want_logits.shape == (3, 64)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(got, want)
        return got

    try:
        r = speculative_decode(target, both, PROMPT, aux_layer_ids=[1, 2, 3], num_speculative_tokens=3,
                               max_new_tokens=40)  # fmt: skip
        # a second prompt through the same proposer: the cache starts over (reset by speculative_decode)
        r2 = speculative_decode(target, cached, PROMPT[:3], aux_layer_ids=[1, 2, 3], num_speculative_tokens=3,
                                max_new_tokens=12)  # fmt: skip
        r2_full = speculative_decode(target, full, PROMPT[:3], aux_layer_ids=[1, 2, 3], num_speculative_tokens=3,
                                     max_new_tokens=12)  # fmt: skip
    finally:
        handle.remove()
    assert calls["n"] == len(r.accepted) > 5
    assert r2.tokens == r2_full.tokens and r2.accepted == r2_full.accepted


def test_cached_proposer_starts_over_on_another_prefix(target, draft):
    """Without reset, a sequence that does not extend the cached one is recomputed from scratch."""
    from peagle.eval.reference import CachedDraftProposer, TargetStepper

    stepper = TargetStepper(target, [1, 2, 3])
    _, aux = stepper.forward(PROMPT)
    seq = torch.tensor([*PROMPT, 9])
    cached, full = CachedDraftProposer(draft, 3), DraftProposer(draft, 3)
    cached(seq, aux)
    other = seq.clone()
    other[2] = 11  # same length, different prefix
    assert torch.equal(cached(other[:-2], aux[:-2]), full(other[:-2], aux[:-2]))
    assert torch.equal(cached(other, aux), full(other, aux))
