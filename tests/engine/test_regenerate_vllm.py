"""Regeneration through a real vLLM engine (SmolLM2, slow): multi-turn order, on_length, drops, a prompt
without an answer answered (issue 38: prompts-only data), and a job
killed mid-way that resumes to the same answers as an uninterrupted run, then a second job that starts no engine.

Three engine starts in all (about 40 s each): one fp32 engine shared by this module's tests, the killed
job's, and the resumed job's.

Determinism (the resume test compares answers exactly): fp32 weights, greedy decoding, one conversation in
flight (``batch_size: 1``) and no prefix caching. Then every request is computed alone, from its own prompt
only, whichever engine serves it and whatever ran before, so an answer cannot depend on what was in flight
beside it (continuous batching changes the kernel shapes, which in bf16 can flip a near-tied argmax) nor on
a cached prefix computed in another batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peagle.data.regenerate import RegenResult, RegenSettings, regenerate_conversations
from peagle.data.regenerate_cache import REGEN_CACHE_ENV
from peagle.data.regenerate_engines import TurnRequest, TurnResult, VllmBackend
from peagle.engine.locate import vllm_python
from peagle.engine.server import EngineConfig, VllmServer
from peagle.spec.funnel import REGEN_ANSWER_CUT

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH, MAX_NEW = 384, 24
IDENTITY = {"builtin": "builtin:smollm2-135m-instruct"}


def require_vllm() -> None:
    if vllm_python() is not None:
        return
    # a built venv that is not found is a bug (it hid a wrong repo root once): never a skip
    assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
    msg = "vLLM venv missing: run `make vllm-env` (builds .vllm-venv)"
    if os.environ.get("PEAGLE_REQUIRE_SERVICES", "") not in ("", "0", "false"):
        pytest.fail(msg + " — PEAGLE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
    pytest.skip(msg)


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", max_model_len=MAX_LENGTH + MAX_NEW, seed=0,
                        extra_args=("--no-enable-prefix-caching",))


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("regen-engine")
    with VllmServer(engine_config(smollm2_path), log_path=tmp / "engine.log", name="shared regeneration engine") as s:
        yield s


class Recording(VllmBackend):
    """The real backend, remembering every prompt (as the engine got it) and answer."""

    def __init__(self, server: VllmServer, tok) -> None:
        super().__init__(server.base_url, server.served_name, alive=server.check_alive)
        self.tok, self.asked = tok, []

    async def agenerate(self, req: TurnRequest) -> TurnResult:
        res = await super().agenerate(req)
        self.asked.append((self.tok.decode(req.prompt_ids), res))
        return res


def _settings(**kw) -> RegenSettings:
    base = {"engine": "vllm", "dtype": "float32", "temperature": 0.0, "max_new_tokens": MAX_NEW,
            "on_length": "drop", "batch_size": 4, "max_length": MAX_LENGTH, "max_model_len": MAX_LENGTH + MAX_NEW,
            "engine_args": ("--no-enable-prefix-caching",)}
    return RegenSettings(**{**base, **kw})


def _regen(convs, tok, settings, backend, cache) -> RegenResult:
    return regenerate_conversations(convs, tok, settings, identity=IDENTITY, cache_dir=cache,
                                    open_backend=lambda: contextlib.nullcontext(backend))


def _conv(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


def test_multi_turn_order_and_the_rules(server, smollm2_tokenizer, tmp_path):
    convs = [
        _conv(("user", "What is the capital of France?"), ("assistant", "OLD ANSWER"),
              ("user", "And what is the capital of Italy?"), ("assistant", "OLD ANSWER")),
        _conv(("user", "Write a long essay about the history of Rome."), ("assistant", "OLD ANSWER"),
              ("user", "Now summarise it."), ("assistant", "OLD ANSWER")),
        _conv(("system", "You answer briefly."), ("user", "What is 2+2? Answer with one number only."),
              ("assistant", "OLD ANSWER")),
        _conv(("system", "You answer briefly."), ("user", "What is 3+3? Answer with one number only.")),  # no answer
    ]
    backend = Recording(server, smollm2_tokenizer)
    res = _regen(convs, smollm2_tokenizer, _settings(), backend, tmp_path / "drop")
    paris = res.conversations[0]
    assert paris is not None and "Paris" in paris[1]["content"] and "Rome" in paris[3]["content"]
    # turn 2 was asked after turn 1 was answered, with that answer in its prompt
    prompts = [p for p, _r in backend.asked]
    (p1,) = [p for p in prompts if p.endswith("France?<|im_end|>\n<|im_start|>assistant\n")]
    (p2,) = [p for p in prompts if "capital of Italy" in p]
    assert prompts.index(p1) < prompts.index(p2) and paris[1]["content"] + "<|im_end|>" in p2
    assert "OLD ANSWER" not in "".join(prompts)
    assert res.conversations[2] is not None and res.conversations[2][0]["role"] == "system"
    # the prompt without an answer: the target's answer appended, asked with the generation prompt
    answered = res.conversations[3]
    assert answered is not None and [t["role"] for t in answered] == ["system", "user", "assistant"]
    assert answered[:2] == convs[3] and answered[2]["content"].strip()
    (p3,) = [p for p in prompts if "3+3" in p]
    assert p3.endswith("one number only.<|im_end|>\n<|im_start|>assistant\n")
    # the essay is cut at max_new_tokens: dropped under `drop`, and its second turn never asked
    assert res.reasons == {1: REGEN_ANSWER_CUT} and res.report["answers_appended"] == 1
    assert not any("summarise" in p for p in prompts)
    cut = [r for p, r in backend.asked if "history of Rome" in p]
    assert [(r.finish_reason, r.num_tokens) for r in cut] == [("length", MAX_NEW)]
    assert all(r.finish_reason == "stop" and r.num_tokens < MAX_NEW for p, r in backend.asked if "Rome" not in p)
    assert res.report["dropped_by_reason"] == {REGEN_ANSWER_CUT: 1}

    # `keep`: the cut essay stays and its second turn is generated from the cut answer (one more request
    # for it; the other conversations come from the cache)
    keep_backend = Recording(server, smollm2_tokenizer)
    kept = _regen(convs, smollm2_tokenizer, _settings(on_length="keep"), keep_backend, tmp_path / "drop")
    essay = kept.conversations[1]
    assert essay is not None and essay[1]["content"].strip()
    assert kept.reasons == {} and kept.report["answers_cut"] >= 1
    assert kept.report["generated"] == 1 and kept.report["cached"] == 3
    (summary_prompt,) = [p for p, _r in keep_backend.asked if "summarise" in p]
    assert essay[1]["content"] + "<|im_end|>" in summary_prompt


CHILD = """
import json, sys
from transformers import AutoTokenizer
from peagle.data.prepare import prepare_data
from peagle.engine.server import EngineConfig
from peagle.spec import parse_spec
spec, cfg, run = parse_spec(json.loads(sys.argv[1])), json.loads(sys.argv[2]), sys.argv[3]
cfg = EngineConfig(**{**cfg, "extra_args": tuple(cfg["extra_args"])})
prepare_data(spec, AutoTokenizer.from_pretrained(cfg.model), run, target_vocab_size=49152, workers=1,
             regen_engine=cfg)
"""


def _sharegpt_jsonl(path: Path, n: int) -> list[list[dict[str, str]]]:
    """`n` real multi-turn ShareGPT conversations (two exchanges, turns cut to 300 characters)."""
    from peagle.builtin import sharegpt_path
    from peagle.data.formats import IngestReport, iter_rows

    convs = []
    for row in iter_rows(sharegpt_path(), "sharegpt", IngestReport(), max_samples=200):
        m = row.messages or []
        if [t["role"] for t in m[:4]] == ["user", "assistant", "user", "assistant"]:
            convs.append([{"role": t["role"], "content": t["content"][:300]} for t in m[:4]])
        if len(convs) == n:
            break
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return convs


def _engine_gone(log: Path, timeout_s: float = 60.0) -> bool:
    import httpx

    port = re.search(r"--port (\d+)", log.read_text()).group(1)  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
        except httpx.HTTPError:
            return True
        time.sleep(1.0)
    return False


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.logs: list[str] = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))

    def log(self, level, message):
        self.logs.append(message)

    def metric(self, step, epoch, values):
        pass


def test_a_killed_job_resumes_to_the_same_answers_and_a_second_job_starts_no_engine(
        server, smollm2_path, smollm2_tokenizer, tmp_path, monkeypatch):
    from peagle.data.prepare import prepare_data, regeneration_plan
    from peagle.spec import parse_spec

    n = 6
    data = tmp_path / "data.jsonl"
    convs = _sharegpt_jsonl(data, n)
    raw = {"target": {"model": "builtin:smollm2-135m-instruct"},
           "data": {"sources": [{"path": str(data)}], "max_length": MAX_LENGTH,
                    "regenerate": {"enabled": True, "engine": "vllm", "max_new_tokens": MAX_NEW,
                                   "on_length": "keep", "batch_size": 1}},
           "draft": {"draft_vocab_size": 256}, "optim": {"pack_length": 512}}
    spec = parse_spec(raw)
    cfg = engine_config(smollm2_path)
    shared = tmp_path / "shared"
    monkeypatch.setenv(REGEN_CACHE_ENV, str(shared))

    # 1. a job regenerating in a child process, SIGKILLed once two conversations are in the cache
    cfg_json = json.dumps({**cfg.__dict__, "capture": None, "env": []})
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(raw), cfg_json, str(tmp_path / "run1")],
                             env={**os.environ, REGEN_CACHE_ENV: str(shared)}, cwd=REPO)
    deadline = time.monotonic() + 400
    try:
        while True:
            files = list(shared.glob("*.jsonl"))
            if files and files[0].read_text().count("\n") >= 2:
                break
            assert child.poll() is None, f"the job ended before it was killed ({child.returncode})"
            assert time.monotonic() < deadline, "no conversation regenerated in time"
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    done_before = files[0].read_text().count("\n")
    assert done_before < n, "the job finished before it was killed: nothing to resume"
    log1 = tmp_path / "run1" / "logs" / "engine-regenerate.log"
    assert _engine_gone(log1), "the killed job's engine still answers"

    # 2. the job again: it regenerates only what was missing (its own engine: the last start of this module)
    sink = Sink()
    resumed = prepare_data(spec, smollm2_tokenizer, tmp_path / "run1", target_vocab_size=49152, workers=1,
                           regen_engine=cfg, sink=sink)
    rep = resumed.report["regeneration"]
    assert rep["cached"] == done_before and rep["generated"] == n - done_before and rep["kept"] == n
    assert ("phase", {"phase": "regenerating", "message": f"regenerating the answers of {n} conversations "
                      "with the target (vllm)"}) in sink.events
    progress = [f for k, f in sink.events if k == "progress"]  # over what is left; the cached are done at once
    left = n - done_before
    assert progress and progress[-1]["step"] == progress[-1]["total_steps"] == left
    assert progress[0]["regen_conversations"] == done_before and progress[-1]["regen_conversations"] == n
    assert any(line.startswith(f"regenerating {left}/{left} conversations") for line in sink.logs)

    # 3. the same answers as an uninterrupted run (the shared engine, an empty cache)
    plan = regeneration_plan(spec, smollm2_tokenizer, tmp_path, regen_engine=cfg)
    assert plan is not None
    assert plan.settings == _settings(on_length="keep", batch_size=1)
    whole = _regen(convs, smollm2_tokenizer, plan.settings, VllmBackend(server.base_url, server.served_name),
                   tmp_path / "uninterrupted")
    assert whole.report["generated"] == n

    class NoEngine:
        def __enter__(self):
            raise AssertionError("an engine was opened although everything is cached")

        def __exit__(self, *exc):
            pass

    again = regenerate_conversations(convs, smollm2_tokenizer, plan.settings, identity=plan.identity,
                                     cache_dir=shared, open_backend=NoEngine)
    assert again.conversations == whole.conversations
    assert sum(c != w for c, w in zip(convs, again.conversations, strict=True)) == n  # new answers, all of them

    # 4. a second job with the same data in another run dir: no engine started at all
    def refuse(self):
        raise AssertionError("a second job started an engine")

    monkeypatch.setattr(VllmServer, "start", refuse)
    second = prepare_data(spec, smollm2_tokenizer, tmp_path / "run2", target_vocab_size=49152, workers=1,
                          regen_engine=cfg)
    assert second.report["regeneration"]["cached"] == n and second.report["regeneration"]["generated"] == 0
    assert not (tmp_path / "run2" / "logs" / "engine-regenerate.log").exists()
    assert second.report["funnel"] == resumed.report["funnel"]
