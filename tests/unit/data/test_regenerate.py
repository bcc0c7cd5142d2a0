"""The regeneration driver's rules and its cache, with scripted engines (no model): multi-turn order,
limits, on_length, drops, content keys, torn lines, two writers, seeds, progress."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest

from peagle.data.regenerate import (
    LENGTH_MARGIN,
    RegenSettings,
    outcome,
    regenerate_conversations,
    turn_seed,
)
from peagle.data.regenerate_cache import (
    REGEN_CACHE_ENV,
    RegenCache,
    conversation_key,
    group_key,
    regen_cache_dir,
    target_identity,
)
from peagle.data.regenerate_engines import TurnRequest, TurnResult
from peagle.spec.funnel import NO_ASSISTANT_TURN, REGEN_ANSWER_CUT, TOO_LONG
from peagle.spec.metrics import REGEN_CONVERSATIONS, REGEN_TOKENS_PER_S

IDENTITY = {"builtin": "builtin:smollm2-135m-instruct"}


def _settings(**kw) -> RegenSettings:
    base = {"engine": "vllm", "dtype": "float32", "temperature": 0.0, "max_new_tokens": 16, "on_length": "drop",
            "batch_size": 3, "max_length": 256, "max_model_len": 272, "seed": 7}
    return RegenSettings(**{**base, **kw})


class Scripted:
    """A fake engine: answers `reply after <prompt length> tokens to <last user turn>`, a cut answer
    (`length`) when that turn holds CUT, an empty one when it holds SILENT. Records every request."""

    def __init__(self, tokenizer, *, concurrent: bool, shuffle: int | None = None) -> None:
        self.tok, self.concurrent, self.shuffle = tokenizer, concurrent, shuffle
        self.prompts: list[str] = []
        self.requests: list[TurnRequest] = []
        self.opened = 0

    def _answer(self, req: TurnRequest) -> TurnResult:
        text = self.tok.decode(req.prompt_ids)
        self.prompts.append(text)
        self.requests.append(req)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        if "SILENT" in last_user:
            return TurnResult("", "stop", 1)
        if "CUT" in last_user:
            return TurnResult(f"cut answer after {len(req.prompt_ids)}", "length", req.max_tokens)
        return TurnResult(f"reply after {len(req.prompt_ids)} tokens to {last_user}", "stop", 5)

    def generate(self, reqs: list[TurnRequest]) -> list[TurnResult]:
        return [self._answer(r) for r in reqs]

    async def agenerate(self, req: TurnRequest) -> TurnResult:
        if self.shuffle is not None:  # answers come back in another order than asked
            await asyncio.sleep(random.Random(self.shuffle + len(self.prompts)).random() * 0.01)
        return self._answer(req)

    async def aclose(self) -> None:
        pass

    @contextlib.contextmanager
    def open(self):
        self.opened += 1
        yield self


def _conv(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


CONVS = [
    _conv(("user", "first question"), ("assistant", "OLD-1"), ("user", "follow up"), ("assistant", "OLD-2")),
    _conv(("system", "be brief"), ("user", "hello"), ("assistant", "OLD-3")),
    _conv(("user", "only a question")),
    _conv(("user", "please CUT this"), ("assistant", "OLD-4"), ("user", "then this"), ("assistant", "OLD-5")),
]


def _run(tok, convs, settings, engine, tmp_path, **kw):
    return regenerate_conversations(convs, tok, settings, identity=IDENTITY, open_backend=engine.open,
                                    cache_dir=tmp_path / "cache", **kw)


@pytest.mark.parametrize("concurrent", [False, True])
def test_multi_turn_prompts_hold_the_regenerated_answers(smollm2_tokenizer, tmp_path, concurrent):
    eng = Scripted(smollm2_tokenizer, concurrent=concurrent, shuffle=1 if concurrent else None)
    res = _run(smollm2_tokenizer, CONVS, _settings(), eng, tmp_path)
    new = res.conversations[0]
    assert new is not None and [m["role"] for m in new] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in new if m["role"] == "user"] == ["first question", "follow up"]
    first, second = new[1]["content"], new[3]["content"]
    assert first.startswith("reply") and first.endswith("first question") and second.endswith("follow up")
    # turn 2 was asked with the regenerated turn 1 in its prompt, never the dataset's old answer
    (p2,) = [p for p in eng.prompts if "follow up" in p]
    assert first in p2 and "OLD" not in "".join(eng.prompts)
    assert p2.endswith("<|im_start|>assistant\n")  # the target's own template with its generation prompt
    assert res.conversations[1] is not None and res.conversations[1][0] == {"role": "system", "content": "be brief"}
    # a prompt without an answer: the target writes one (appended); an answer cut with on_length drop:
    # dropped, its turn 2 never asked
    answered = res.conversations[2]
    assert answered is not None and answered[0] == CONVS[2][0] and [m["role"] for m in answered] == ["user",
                                                                                                    "assistant"]
    assert answered[1]["content"].startswith("reply") and answered[1]["content"].endswith("to only a question")
    assert res.reasons == {3: REGEN_ANSWER_CUT} and res.report["answers_appended"] == 1
    assert not any("then this" in p for p in eng.prompts)
    assert res.report["dropped_by_reason"] == {REGEN_ANSWER_CUT: 1}
    assert res.report["kept"] == 3 and res.report["generated"] == 4 and res.report["cached"] == 0


def test_on_length_keep_goes_on_from_the_cut_answer(smollm2_tokenizer, tmp_path):
    eng = Scripted(smollm2_tokenizer, concurrent=True)
    res = _run(smollm2_tokenizer, CONVS, _settings(on_length="keep"), eng, tmp_path)
    kept = res.conversations[3]
    assert kept is not None and kept[1]["content"].startswith("cut answer") and kept[3]["content"].endswith("then this")
    assert res.reasons == {} and res.report["answers_cut"] == 1
    # a record made under `drop` stopped at the cut: `keep` cannot use it and generates that conversation again
    eng_drop = Scripted(smollm2_tokenizer, concurrent=True)
    _run(smollm2_tokenizer, CONVS, _settings(), eng_drop, tmp_path / "other")
    eng_keep = Scripted(smollm2_tokenizer, concurrent=True)
    again = _run(smollm2_tokenizer, CONVS, _settings(on_length="keep"), eng_keep, tmp_path / "other")
    assert again.report["generated"] == 1 and again.report["cached"] == 3
    # ... while `drop` reuses everything `keep` made (it drops the cut one when reading)
    eng3 = Scripted(smollm2_tokenizer, concurrent=True)
    third = _run(smollm2_tokenizer, CONVS, _settings(), eng3, tmp_path)
    assert eng3.opened == 0 and third.reasons == {3: REGEN_ANSWER_CUT}


def test_empty_answers_and_long_prompts(smollm2_tokenizer, tmp_path):
    long = "word " * 300
    convs = [
        _conv(("user", "SILENT please"), ("assistant", "x")),  # the target answers nothing
        _conv(("user", long), ("assistant", "x")),  # the first prompt already reaches max_length
        _conv(("user", "short"), ("assistant", "x"), ("user", long), ("assistant", "y")),  # the second does
    ]
    eng = Scripted(smollm2_tokenizer, concurrent=False)
    res = _run(smollm2_tokenizer, convs, _settings(max_length=200, max_model_len=216), eng, tmp_path)
    assert res.reasons == {0: NO_ASSISTANT_TURN, 1: TOO_LONG}
    kept = res.conversations[2]
    assert kept is not None and [m["role"] for m in kept] == ["user", "assistant", "user"]  # stopped there
    assert res.report["stopped_at_max_length"] == 1 and len(eng.prompts) == 2


def test_max_tokens_is_clamped_to_the_context(smollm2_tokenizer, tmp_path):
    eng = Scripted(smollm2_tokenizer, concurrent=False)
    _run(smollm2_tokenizer, CONVS[:1], _settings(max_new_tokens=500, max_length=256, max_model_len=266), eng, tmp_path)
    for req in eng.requests:  # the engine's context is the tightest clamp here
        assert req.max_tokens == 266 - len(req.prompt_ids) and req.max_tokens < 500
    # training keeps max_length tokens: an answer is not generated past them (plus the margin)
    eng_row = Scripted(smollm2_tokenizer, concurrent=False)
    _run(smollm2_tokenizer, CONVS[:1], _settings(max_new_tokens=500, max_length=200, max_model_len=800), eng_row,
         tmp_path / "row")
    assert eng_row.requests
    for req in eng_row.requests:
        assert req.max_tokens == 200 - len(req.prompt_ids) + LENGTH_MARGIN
    # an engine context shorter than data.max_length ends the conversation like max_length does
    eng2 = Scripted(smollm2_tokenizer, concurrent=False)
    p1 = len(eng.requests[0].prompt_ids)
    res = _run(smollm2_tokenizer, CONVS[:1], _settings(max_length=256, max_model_len=p1), eng2, tmp_path / "b")
    assert eng2.requests == [] and res.reasons == {0: TOO_LONG}


@pytest.mark.parametrize("on_length", ["drop", "keep"])
def test_an_answer_cut_at_max_length_is_kept_and_ends_the_conversation(smollm2_tokenizer, tmp_path, on_length):
    # the engine cuts the CUT answer at whatever max_tokens says: here that is data.max_length's clamp
    eng = Scripted(smollm2_tokenizer, concurrent=False)
    res = _run(smollm2_tokenizer, CONVS[3:], _settings(on_length=on_length, max_new_tokens=500, max_length=120,
                                                       max_model_len=800), eng, tmp_path)
    (req,) = eng.requests  # its second turn is never asked: training would cut it away
    assert req.max_tokens == 120 - len(req.prompt_ids) + LENGTH_MARGIN
    kept = res.conversations[0]
    assert kept is not None and [m["role"] for m in kept] == ["user", "assistant"]
    assert res.reasons == {} and res.report["answers_cut"] == 0 and res.report["stopped_at_max_length"] == 1
    (line,) = [json.loads(x) for x in Path(res.report["cache_file"]).read_text().splitlines()]
    assert line["finish"] == ["max_length"] and line["stop"] == "max_length"
    # a record made under either rule serves the other from the cache
    other = "keep" if on_length == "drop" else "drop"
    eng2 = Scripted(smollm2_tokenizer, concurrent=False)
    again = _run(smollm2_tokenizer, CONVS[3:], _settings(on_length=other, max_new_tokens=500, max_length=120,
                                                         max_model_len=800), eng2, tmp_path)
    assert eng2.opened == 0 and again.conversations == res.conversations


def test_the_margin_keeps_a_cut_answers_end_of_turn_out_of_the_row(smollm2_tokenizer, tmp_path):
    # an engine whose max_tokens answer tokenises into 10 fewer tokens the second time (non-canonical tokens
    # merging): the row still ends inside the answer, never on the end-of-turn marker a cut answer gets
    from peagle.data.template import tokenize_conversation

    class Merging(Scripted):
        def _answer(self, req: TurnRequest) -> TurnResult:
            self.requests.append(req)
            return TurnResult(" word" * (req.max_tokens - 10), "length", req.max_tokens)

    eng = Merging(smollm2_tokenizer, concurrent=False)
    res = _run(smollm2_tokenizer, CONVS[:1], _settings(max_new_tokens=500, max_length=100, max_model_len=800), eng,
               tmp_path)
    (conv,) = res.conversations
    assert conv is not None and len(eng.requests) == 1
    row = tokenize_conversation(smollm2_tokenizer, conv, max_length=100)
    p = len(eng.requests[0].prompt_ids)
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row.truncated and len(row.input_ids) == 100 and im_end not in row.input_ids[p:]
    assert row.loss_mask[p:] == [1] * (100 - p)


def test_cache_is_keyed_by_content_not_position(smollm2_tokenizer, tmp_path):
    eng = Scripted(smollm2_tokenizer, concurrent=True)
    first = _run(smollm2_tokenizer, CONVS, _settings(), eng, tmp_path)
    # another job: other order, other old answers, a duplicate, one new conversation
    moved = [CONVS[1], [dict(m, content="different old") if m["role"] == "assistant" else m for m in CONVS[0]],
             CONVS[1], _conv(("user", "brand new"), ("assistant", "x"))]
    eng2 = Scripted(smollm2_tokenizer, concurrent=True)
    second = _run(smollm2_tokenizer, moved, _settings(batch_size=1), eng2, tmp_path)
    assert eng2.opened == 1 and len(eng2.prompts) == 1 and "brand new" in eng2.prompts[0]
    assert second.conversations[1] == first.conversations[0] and second.conversations[0] == first.conversations[1]
    assert second.report["cached"] == 3 and second.report["generated"] == 1
    # all cached: the engine is not even opened
    eng3 = Scripted(smollm2_tokenizer, concurrent=True)
    third = _run(smollm2_tokenizer, moved, _settings(), eng3, tmp_path)
    assert eng3.opened == 0 and third.conversations == second.conversations
    # a setting that changes the answers is another group: nothing reused
    eng4 = Scripted(smollm2_tokenizer, concurrent=True)
    _run(smollm2_tokenizer, moved, _settings(max_new_tokens=17), eng4, tmp_path)
    assert len(eng4.prompts) == 4


def test_a_torn_last_line_is_skipped_and_closed(smollm2_tokenizer, tmp_path):
    eng = Scripted(smollm2_tokenizer, concurrent=False)
    first = _run(smollm2_tokenizer, CONVS[:2], _settings(), eng, tmp_path)
    (path,) = (tmp_path / "cache").glob("*.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed while writing the second record
    eng2 = Scripted(smollm2_tokenizer, concurrent=False)
    again = _run(smollm2_tokenizer, CONVS[:2], _settings(), eng2, tmp_path)
    assert again.report["generated"] == 1 and again.report["cached"] == 1
    rows = path.read_text().splitlines()
    assert len(rows) == 3 and json.loads(rows[0]) and json.loads(rows[2])  # the torn line stays alone on its line
    # conversation 1 finished first (one turn), so conversation 0's record was the torn one: generated again
    assert again.conversations == first.conversations and len(eng2.prompts) == 2


def _writer(folder: str, group: str, tag: str, n: int) -> None:
    with RegenCache(folder, group) as c:
        for i in range(n):
            key = conversation_key(group, [{"role": "user", "content": f"{tag}-{i}"}])
            c.append({"key": key, "messages": [{"role": "user", "content": "x" * 5000}], "finish": ["stop"],
                      "stop": None, "tokens": i})


def test_two_writers_never_interleave(tmp_path):
    group = "g" * 64
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), group, t, 150)) for t in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = (tmp_path / f"{group}.jsonl").read_text().splitlines()
    assert len(rows) == 300 and all(json.loads(r)["messages"][0]["content"] == "x" * 5000 for r in rows)


@pytest.mark.parametrize("concurrent", [False, True])
def test_sampling_seeds_do_not_depend_on_batch_order(smollm2_tokenizer, tmp_path, concurrent):
    s = _settings(temperature=0.7, batch_size=2)
    eng = Scripted(smollm2_tokenizer, concurrent=concurrent, shuffle=3 if concurrent else None)
    _run(smollm2_tokenizer, CONVS, s, eng, tmp_path / "a")
    eng2 = Scripted(smollm2_tokenizer, concurrent=not concurrent)
    _run(smollm2_tokenizer, CONVS[::-1], RegenSettings(**{**s.__dict__, "batch_size": 1}), eng2, tmp_path / "b")
    seeds = {p: r.seed for p, r in zip(eng.prompts, eng.requests, strict=True)}
    assert seeds == {p: r.seed for p, r in zip(eng2.prompts, eng2.requests, strict=True)}
    assert len(set(seeds.values())) == len(seeds)  # every turn has its own seed
    group = group_key(IDENTITY, s.key_fields())
    assert eng.requests[0].seed in {turn_seed(conversation_key(group, c), 0, 7) for c in CONVS}
    # the seed is part of the cache group when sampling, not when greedy
    assert group != group_key(IDENTITY, RegenSettings(**{**s.__dict__, "seed": 8}).key_fields())
    g0 = _settings()
    assert group_key(IDENTITY, g0.key_fields()) == group_key(IDENTITY, _settings(seed=8).key_fields())


class Sink:
    def __init__(self) -> None:
        self.records: list[tuple] = []

    def event(self, kind, **fields):
        self.records.append(("event", kind, fields))

    def log(self, level, message):
        self.records.append(("log", level, message))

    def metric(self, step, epoch, values):
        self.records.append(("metric", step, values))


def test_progress_is_rate_limited_and_says_done_total_rate_eta(smollm2_tokenizer, tmp_path):
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # every clock read is one second later
        return now[0]

    sink = Sink()
    convs = [_conv(("user", f"q{i}"), ("assistant", "x")) for i in range(12)]
    eng = Scripted(smollm2_tokenizer, concurrent=False)
    _run(smollm2_tokenizer, convs, _settings(batch_size=1), eng, tmp_path, sink=sink, clock=clock,
         progress_every_s=5.0)
    events = [f for r, k, f in sink.records if r == "event" and k == "progress"]
    assert 2 <= len(events) < 12 and events[-1]["step"] == events[-1]["total_steps"] == 12
    assert all(e["phase"] == "regenerating" and e[REGEN_CONVERSATIONS] == e["step"] for e in events)
    assert events[-1][REGEN_TOKENS_PER_S] > 0
    lines = [m for r, _l, m in sink.records if r == "log"]
    # at once a record before the engine starts, and a 0-done record once it is up (issue 39: minutes of silence)
    assert lines[0] == "regenerating 12 conversations (0 of 12 from the cache): starting the vllm engine"
    assert events[1]["step"] == 0 and lines[1] == "regenerating 0/12 conversations (0%)"
    assert len(lines) == len(events) and lines[2].startswith("regenerating 1/12 conversations (8%) tokens/s")
    assert any("eta" in m for m in lines[2:-1]) and "eta" not in lines[-1]  # (smoothed: after 3 answers)

    # the job log's step lines ignore them (training keeps its own ETA origin)
    from peagle.progress import ProgressLog

    rec = Sink()
    log = ProgressLog(rec)  # type: ignore[arg-type]
    log.event("progress", **events[0])
    log.event("progress", step=1, total_steps=10, epoch=0.1)
    assert [m for r, _l, m in rec.records if r == "log"] == ["step 1/10 (10%)"]


def test_outcome_rules() -> None:
    rec = {"messages": _conv(("user", "q"), ("assistant", "a")), "finish": ["length"], "stop": None}
    assert outcome(rec, "drop") == (None, REGEN_ANSWER_CUT)
    assert outcome(rec, "keep")[0] == rec["messages"]
    assert outcome({"messages": _conv(("user", "q")), "finish": [], "stop": "max_length"}, "drop") == (None, TOO_LONG)
    assert outcome({"messages": _conv(("user", "q"), ("assistant", " ")), "finish": ["stop"], "stop": None},
                   "keep") == (None, NO_ASSISTANT_TURN)


def test_target_identity_and_cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"0" * 10)
    (folder / "README.md").write_text("not part of it")
    a = target_identity(str(folder), None)
    assert a["folder"] == str(folder.resolve()) and [f[0] for f in a["files"]] == ["config.json", "model.safetensors"]
    (folder / "README.md").write_text("changed")
    assert target_identity(str(folder), None) == a
    (folder / "model.safetensors").write_bytes(b"1" * 11)  # replaced weights: another identity
    assert target_identity(str(folder), None) != a
    os.utime(folder / "config.json", ns=(1, 1))
    assert target_identity(str(folder), None) != a
    assert target_identity("org/model", "abc") == {"hub": "org/model", "revision": "abc"}
    assert target_identity("builtin:tiny-llama", None) == {"builtin": "builtin:tiny-llama"}
    monkeypatch.setenv(REGEN_CACHE_ENV, str(tmp_path / "shared"))
    assert regen_cache_dir() == tmp_path / "shared"
    monkeypatch.delenv(REGEN_CACHE_ENV)
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "root"))
    assert regen_cache_dir() == Path(tmp_path / "root" / "regenerate")


def test_conversation_key_ignores_old_answers_only() -> None:
    a = _conv(("user", "q"), ("assistant", "a1"))
    assert conversation_key("g", a) == conversation_key("g", _conv(("user", "q"), ("assistant", "zzz")))
    assert conversation_key("g", a) != conversation_key("g", _conv(("user", "q2"), ("assistant", "a1")))
    assert conversation_key("g", a) != conversation_key("h", a)
    assert conversation_key("g", a) != conversation_key("g", [*a, {"role": "user", "content": "more"}])


def _prepare_spec(path: Path, **regen) -> object:
    from peagle.spec import parse_spec

    return parse_spec({
        "target": {"model": "builtin:smollm2-135m-instruct"},
        "data": {"sources": [{"path": str(path)}], "max_length": 96, "eval_samples": 1,
                 "regenerate": {"enabled": "auto", "max_new_tokens": 8, **regen}},
        "draft": {"draft_vocab_size": 64}, "optim": {"pack_length": 256},
    })


def test_prepare_data_files_regeneration_drops_in_the_funnel(smollm2_tokenizer, tmp_path, monkeypatch):
    """prepare_data with the vLLM engine (scripted here): `auto` resolved, the engine opened only when
    something is left, the phase announced, every drop in the funnel, the data cache keyed by the group."""
    import peagle.data.regenerate_engines as engines
    from peagle.data.prepare import data_cache_key, prepare_data, regeneration_plan, resolve_regeneration
    from peagle.engine.server import EngineConfig

    rows = [
        _conv(("user", "hello"), ("assistant", "old"), ("user", "and then"), ("assistant", "old")),
        _conv(("user", "please CUT"), ("assistant", "old")),
        _conv(("user", "SILENT"), ("assistant", "old")),
        _conv(("user", "word " * 120), ("assistant", "old")),  # its prompt reaches max_length
        _conv(("user", "a question"), ("assistant", "old")),
        _conv(("user", "only a prompt")),  # prompts-only: kept by ingestion, the target writes its answer
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    monkeypatch.setenv(REGEN_CACHE_ENV, str(tmp_path / "shared"))
    eng = Scripted(smollm2_tokenizer, concurrent=True)
    opened: list[tuple] = []

    @contextlib.contextmanager
    def fake_open(config, log_path, **kw):
        opened.append((config, Path(log_path)))
        with eng.open() as backend:
            yield backend

    monkeypatch.setattr(engines, "open_vllm_backend", fake_open)
    cfg = EngineConfig(model="/nowhere", dtype="bfloat16", max_model_len=104)
    spec = _prepare_spec(data)
    assert resolve_regeneration(spec, vllm=False) == (False, "hf")  # "auto" is never truthy by itself
    assert resolve_regeneration(spec, vllm=True) == (True, "vllm")
    sink = Sink()
    pd = prepare_data(spec, smollm2_tokenizer, tmp_path / "run", target_vocab_size=49152, workers=1, sink=sink,
                      regen_engine=cfg)
    assert [o[1] for o in opened] == [tmp_path / "run" / "logs" / "engine-regenerate.log"]
    f = pd.report["funnel"]
    assert f["dropped_by_reason"] == {NO_ASSISTANT_TURN: 1, REGEN_ANSWER_CUT: 1, TOO_LONG: 1}
    assert f["read"] == f["kept"] + f["dropped"] == 6 and f["kept"] == 3 and f["prompts_only"] == 1
    reg = pd.report["regeneration"]
    assert (reg["conversations"], reg["generated"], reg["cached"], reg["kept"]) == (6, 5, 0, 3)
    assert reg["answers_appended"] == 1
    assert any(b["reason"].startswith(REGEN_ANSWER_CUT) for b in pd.report["bad_rows"])
    phases = [fl["phase"] for r, k, fl in sink.records if r == "event" and k == "phase"]
    assert phases == ["preparing_data", "regenerating", "building_vocab"]
    # the rows hold the target's answers, not the dataset's
    text = smollm2_tokenizer.decode(pd.train.input_ids[pd.train.input_ids != 0].tolist() +
                                    pd.eval.input_ids[pd.eval.input_ids != 0].tolist())
    assert "reply after" in text and "old" not in text
    # a second job (another run dir): everything from the shared cache, no engine
    again = prepare_data(spec, smollm2_tokenizer, tmp_path / "run2", target_vocab_size=49152, workers=1,
                         regen_engine=cfg)
    assert len(opened) == 1 and again.report["regeneration"]["cached"] == 5
    assert torch_equal(again.train.input_ids, pd.train.input_ids)
    # what changes the regenerated data changes the data cache key
    plan = regeneration_plan(spec, smollm2_tokenizer, tmp_path, regen_engine=cfg)
    other = regeneration_plan(spec, smollm2_tokenizer, tmp_path,
                              regen_engine=EngineConfig(model="/nowhere", dtype="float32", max_model_len=104))
    assert plan is not None and other is not None and plan.group != other.group
    assert data_cache_key(spec, plan.group) != data_cache_key(spec, other.group) != data_cache_key(spec)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_regeneration_runs_under_a_running_event_loop(smollm2_tokenizer, tmp_path):
    """A caller inside a running loop (a notebook; Playwright's sync API between calls) regenerates the same
    answers: the concurrent client no longer calls asyncio.run there (it raised RuntimeError)."""
    import asyncio

    plain = _run(smollm2_tokenizer, CONVS, _settings(), Scripted(smollm2_tokenizer, concurrent=True),
                 tmp_path / "plain")

    async def inside_a_loop():
        return _run(smollm2_tokenizer, CONVS, _settings(), Scripted(smollm2_tokenizer, concurrent=True),
                    tmp_path / "loop")

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:  # a thread with no loop of its own yet
        res = pool.submit(asyncio.run, inside_a_loop()).result()
    assert res.conversations == plain.conversations and res.reasons == plain.reasons


class SlowTurns(Scripted):
    """Each answer takes `delay` seconds (a CPU engine: a first conversation can take minutes)."""

    def __init__(self, tokenizer, *, delay: float) -> None:
        super().__init__(tokenizer, concurrent=True)
        self.delay = delay

    async def agenerate(self, req: TurnRequest) -> TurnResult:
        await asyncio.sleep(self.delay)
        return self._answer(req)


def test_a_long_first_conversation_still_gets_lines(smollm2_tokenizer, tmp_path):
    """Issue 39: nothing in the job log for five minutes of regeneration. A line before the engine starts,
    one when it is up, and while no conversation finishes, a line every `progress_every_s` that says how
    many answers came back."""
    sink = Sink()
    convs = [_conv(("user", "q1"), ("assistant", "a"), ("user", "q2"), ("assistant", "b"), ("user", "q3"),
                   ("assistant", "c"))]
    _run(smollm2_tokenizer, convs, _settings(batch_size=1), SlowTurns(smollm2_tokenizer, delay=0.5), tmp_path,
         sink=sink, progress_every_s=0.3)
    lines = [m for r, _l, m in sink.records if r == "log"]
    assert lines[0].startswith("regenerating 1 conversations (0 of 1 from the cache): starting the")
    assert lines[1] == "regenerating 0/1 conversations (0%)"
    waiting = [line for line in lines if line.startswith("regenerating 0/1 conversations (0%) ")]
    assert len(waiting) >= 2 and "answers back tokens/s" in waiting[-1] and "generating for" in waiting[-1], lines
    assert lines[-1].startswith("regenerating 1/1 conversations (100%) tokens/s")
