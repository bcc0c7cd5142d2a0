"""Prompts-only data (issue 38): OpenAI chat-completions request bodies and prompt lists are read; a row
with no answer that ends with a user turn is kept when the job regenerates (the target writes the answer),
skipped and counted when it does not, and a source of nothing but such rows is refused, naming it."""

from __future__ import annotations

import json

import pytest

from peagle.data.formats import IngestReport, detect_format, iter_rows, validate_dataset
from peagle.data.regenerate_cache import REGEN_CACHE_ENV
from peagle.errors import DataInvalidError
from peagle.spec import parse_spec
from peagle.spec.funnel import NO_ASSISTANT_TURN, PROMPTS_ONLY

# request bodies as a proxy logs them: the model, sampling fields, tools; a developer message
BODIES = [
    {"model": "gpt-4o-mini", "temperature": 0.7, "stream": True, "max_tokens": 256,
     "messages": [{"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"}]},
    {"model": "m", "tools": [{"type": "function", "function": {"name": "f"}}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "fruit."}]}]},
    {"model": "m", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "How are you?"}]},  # has an answer: trainable as is
    {"model": "m", "messages": [{"role": "system", "content": "no prompt at all"}]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_request_bodies_keep_their_messages_and_prompts_only_rows_are_counted(tmp_path):
    path = _jsonl(tmp_path / "bodies.jsonl", BODIES)
    assert detect_format(path) == ("jsonl", "messages")
    rep = IngestReport()
    rows = list(iter_rows(path, "auto", rep))
    # without regeneration only the row with an answer is kept; the two prompts-only rows are counted
    assert [r.index for r in rows] == [2] and not rows[0].prompt_only
    assert rep.prompts_only == 2 and rep.skipped_by_reason == {NO_ASSISTANT_TURN: 3}
    assert [b["index"] for b in rep.bad_rows] == [3]  # a prompts-only row is not malformed: not listed
    # with regeneration they are kept, messages only (model, temperature, tools ignored)
    rep2 = IngestReport()
    kept = list(iter_rows(path, "auto", rep2, keep_prompts_only=True))
    assert [(r.index, r.prompt_only) for r in kept] == [(0, True), (1, True), (2, False)]
    assert kept[0].messages == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "What is the capital of France?"}]
    assert kept[1].messages == [{"role": "user", "content": "Name a fruit."}]
    assert rep2.prompts_only == 2 and rep2.rows_kept == 3 and rep2.skipped_by_reason == {NO_ASSISTANT_TURN: 1}


@pytest.mark.parametrize("content,container", [
    ('{"prompt": "Write a haiku.", "model": "m", "max_tokens": 9}\n"Say hi."\n{"prompt": "  "}\n{"prompt": 3}\n',
     "jsonl"),
    ('["Write a haiku.", "Say hi.", {"prompt": ""}, {"prompt": ["a", "b"]}]', "array"),
])
def test_prompt_lists(tmp_path, content, container):
    path = tmp_path / "prompts.json"
    path.write_text(content)
    assert detect_format(path) == (container, "prompt")
    rep = IngestReport()
    kept = list(iter_rows(path, "auto", rep, keep_prompts_only=True))
    assert [r.messages for r in kept] == [[{"role": "user", "content": "Write a haiku."}],
                                          [{"role": "user", "content": "Say hi."}]]
    assert all(r.prompt_only for r in kept) and rep.prompts_only == 2
    assert rep.skipped_by_reason == {"empty_conversation": 1, "wrong_type": 1}
    assert [b["line"] for b in rep.bad_rows] == ([3, 4] if container == "jsonl" else [1, 1])


def test_the_validator_reports_prompts_only_datasets_as_usable(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"question {i}"} for i in range(5)])
    rep = validate_dataset(path)
    assert rep["ok"] is True and rep["error"] is None and rep["format"] == "prompt"
    # rows_kept counts rows with an answer; prompts_only the rows a job can use only by regenerating
    assert (rep["rows_read"], rep["rows_kept"], rep["prompts_only"]) == (5, 0, 5)
    assert rep["funnel"][PROMPTS_ONLY] == 5 and rep["funnel"]["dropped_by_reason"] == {NO_ASSISTANT_TURN: 5}
    mixed = validate_dataset(_jsonl(tmp_path / "b.jsonl", BODIES))
    assert (mixed["rows_kept"], mixed["prompts_only"], mixed["funnel"][PROMPTS_ONLY]) == (1, 2, 2)
    nothing = validate_dataset(_jsonl(tmp_path / "n.jsonl", [BODIES[3]]))
    assert nothing["ok"] is False and "no usable row" in nothing["error"] and nothing["prompts_only"] == 0


def _spec(*sources, regenerate: dict | None = None):
    return parse_spec({
        "target": {"model": "builtin:tiny-llama"},
        "data": {"sources": [{"path": str(p)} for p in sources], "max_length": 64,
                 "regenerate": regenerate or {"enabled": False}},
        "draft": {"draft_vocab_size": 64}, "optim": {"pack_length": 128},
    })


def test_without_regeneration_prompts_only_rows_are_dropped_and_a_source_of_them_refused(smollm2_tokenizer,
                                                                                         tmp_path):
    from peagle.data.prepare import prepare_data

    chats = _jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"},
                                                            {"role": "assistant", "content": f"answer {i}"}]}
                                              for i in range(4)])
    bodies = _jsonl(tmp_path / "bodies.jsonl", BODIES)
    pd = prepare_data(_spec(chats, bodies), smollm2_tokenizer, tmp_path / "run", target_vocab_size=49152, workers=1)
    f = pd.report["funnel"]
    assert (f["read"], f["kept"], f[PROMPTS_ONLY]) == (8, 5, 2)
    assert f["dropped_by_reason"] == {NO_ASSISTANT_TURN: 3}
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(3)] + [BODIES[3]])
    with pytest.raises(DataInvalidError) as exc:
        prepare_data(_spec(chats, prompts), smollm2_tokenizer, tmp_path / "run2", target_vocab_size=49152,
                     workers=1)
    assert str(exc.value) == ("data.sources.1.path: 3 of 4 rows end with a user turn and have no answer to train "
                              "on; turn on data.regenerate.enabled so the target writes them")


def test_with_regeneration_the_target_answers_the_prompts(tiny_model, smollm2_tokenizer, tmp_path, monkeypatch):
    """hf regeneration (tiny random Llama, sampled: its greedy answers are only newlines): every prompts-only
    row is kept with one answer appended, the others regenerate as before; the funnel counts them."""
    from peagle.data.prepare import prepare_data

    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Question number {i}?"} for i in range(3)])
    bodies = _jsonl(tmp_path / "bodies.jsonl", BODIES)
    monkeypatch.setenv(REGEN_CACHE_ENV, str(tmp_path / "shared"))
    spec = _spec(prompts, bodies, regenerate={"enabled": True, "engine": "hf", "max_new_tokens": 4,
                                              "on_length": "keep", "temperature": 1.0})
    pd = prepare_data(spec, smollm2_tokenizer, tmp_path / "run", target_vocab_size=49152, workers=1,
                      model=tiny_model)
    f, reg = pd.report["funnel"], pd.report["regeneration"]
    assert (f["read"], f["kept"], f[PROMPTS_ONLY]) == (7, 6, 5)
    assert f["dropped_by_reason"] == {NO_ASSISTANT_TURN: 1}  # the system-only row: nothing to answer
    # 3 prompts + 2 request bodies answered; the Hi/How are you row: its answer regenerated, its last prompt
    # answered too
    assert (reg["conversations"], reg["generated"], reg["answers_appended"], reg["kept"]) == (6, 6, 6, 6)
    assert pd.report["train_conversations"] == 6 and pd.train.loss_mask.sum() > 0


def test_a_prompt_list_is_a_prompt_set(smollm2_tokenizer, tmp_path):
    from peagle.data.prompts import dataset_prompts, tokenize_prompts

    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["Write a haiku.", {"prompt": "Say hi.", "model": "m"}]))
    assert dataset_prompts(path, smollm2_tokenizer, 8) == tokenize_prompts(smollm2_tokenizer,
                                                                           ["Write a haiku.", "Say hi."])
    bodies = _jsonl(tmp_path / "bodies.jsonl", BODIES)  # each request up to its first answer
    got = dataset_prompts(bodies, smollm2_tokenizer, 8)
    assert len(got) == 3 and got[2] == tokenize_prompts(smollm2_tokenizer, ["Hi"])[0]


def test_a_prompt_and_the_same_prompt_with_an_old_answer_share_the_cache(smollm2_tokenizer, tmp_path):
    import contextlib

    from peagle.data.regenerate import RegenSettings, regenerate_conversations
    from peagle.data.regenerate_engines import TurnResult

    class Echo:  # a scripted engine: one fixed answer per request, counted
        concurrent = False
        asked = 0

        def generate(self, reqs):
            Echo.asked += len(reqs)
            return [TurnResult("the answer", "stop", 3) for _ in reqs]

    s = RegenSettings(engine="hf", dtype="float32", temperature=0.0, max_new_tokens=8, on_length="drop",
                      batch_size=4, max_length=128, max_model_len=136)

    def run(convs):
        return regenerate_conversations(convs, smollm2_tokenizer, s, identity={"builtin": "x"}, cache_dir=tmp_path,
                                        open_backend=lambda: contextlib.nullcontext(Echo()))

    prompt = [{"role": "user", "content": "Why is the sky blue?"}]
    first = run([prompt])
    assert first.conversations == [[*prompt, {"role": "assistant", "content": "the answer"}]] and Echo.asked == 1
    again = run([[*prompt, {"role": "assistant", "content": "another model's answer"}]])
    assert again.report["cached"] == 1 and again.report["generated"] == 0 and Echo.asked == 1
    assert again.conversations == first.conversations
