"""Chat templating + assistant masks with SmolLM2's real template and tokenizer."""

from __future__ import annotations

from peagle.data.template import tokenize_conversation, tokenize_many

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>add them</think>\n\nIt is 6."},
]


def _segments(tok, enc):
    """Supervised stretches, decoded (special tokens kept)."""
    out, cur = [], []
    for i, m in zip(enc.input_ids, enc.loss_mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def test_mask_is_exactly_assistant_content_and_end_of_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    enc = tokenize_conversation(tok, CONV, max_length=4096)
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert tok.decode(enc.input_ids) == full  # one row for the whole conversation
    assert _segments(tok, enc) == ["It is 4.<|im_end|>", "<think>add them</think>\n\nIt is 6.<|im_end|>"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ends = [m for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if i == im_end]
    assert ends == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant turns
    assert all(m == 0 for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if i == im_start)
    # the header "<|im_start|>assistant\n" is never supervised
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = enc.input_ids
    for s in range(len(ids) - len(header) + 1):
        if ids[s : s + len(header)] == header:
            assert enc.loss_mask[s : s + len(header)] == [0] * len(header)


def test_default_system_prompt_not_supervised(smollm2_tokenizer):
    enc = tokenize_conversation(smollm2_tokenizer, CONV[1:3], max_length=4096)
    assert _segments(smollm2_tokenizer, enc) == ["It is 4.<|im_end|>"]


def test_think_mask_and_drop(smollm2_tokenizer):
    tok = smollm2_tokenizer
    masked = tokenize_conversation(tok, CONV, max_length=4096, think="mask")
    assert _segments(tok, masked) == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]
    assert "<think>" in tok.decode(masked.input_ids)
    dropped = tokenize_conversation(tok, CONV, max_length=4096, think="drop")
    assert "<think>" not in tok.decode(dropped.input_ids)
    assert _segments(tok, dropped) == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]


def test_truncation_and_zero_assistant_row(smollm2_tokenizer):
    tok = smollm2_tokenizer
    full = tokenize_conversation(tok, CONV, max_length=4096)
    cut = tokenize_conversation(tok, CONV, max_length=20)
    assert cut.truncated and len(cut.input_ids) == 20
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert sum(cut.loss_mask) == 0  # a 0-assistant-token row: prepare_data skips it (reported)


def test_real_sharegpt_rows(smollm2_tokenizer, sharegpt_rows):
    tok = smollm2_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    encs = tokenize_many(tok, sharegpt_rows[:20], max_length=100_000, workers=1)
    for msgs, enc in zip(sharegpt_rows[:20], encs, strict=True):
        n_assistant = sum(m["role"] == "assistant" for m in msgs)
        supervised_ends = sum(m for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if i == im_end)
        assert supervised_ends == n_assistant
        # supervised text = the assistant contents (+ end of turn), in order
        segs = "".join(_segments(tok, enc))
        expect = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
        assert segs == expect


def test_many_uses_processes_and_keeps_order(smollm2_tokenizer, sharegpt_rows):
    convs = sharegpt_rows * 8
    seq = tokenize_many(smollm2_tokenizer, convs, max_length=512, workers=1)
    par = tokenize_many(smollm2_tokenizer, convs, max_length=512, workers=2, chunk_size=16)
    assert [(e.input_ids, e.loss_mask) for e in seq] == [(e.input_ids, e.loss_mask) for e in par]
