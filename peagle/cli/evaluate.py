"""The body of `peagle eval` (its command is `peagle.cli.run.eval_cmd`): AL of an export with the reference
decoder, vLLM or both, per prompt set, and (vLLM) the measured serving speedup.

    report = run_eval("runs/x/export", prompts=["humaneval", "sharegpt-heldout"], num_prompts=8,
                      max_new_tokens=64, engine="vllm", speedup=plan_speedup(4, 8))

With vLLM, an export that carries the parity record of its job (`parity.json`, `peagle.eval.parity`) is
also measured on the recorded prompts at the recorded K and max_new_tokens (in the same engine start when
those equal the asked ones) and put through the served-parity gate: the report's `parity` says whether vLLM
accepts what the reference decoder did (`peagle eval` then exits 12, `served_parity_failed`, when not).

Every AL is the pooled definition of `peagle.eval.acceptance`, whichever engine measured it. Progress goes
to `sink` (`peagle eval` gives it a `ConsoleSink` on stderr): what is being measured, each prompt set's AL as
it comes, and while the vLLM probe runs (engine starts, every K and batch size of a sweep) a line every
`HEARTBEAT_S` seconds.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle.eval.speedup import SpeedupPlan
from peagle.progress import NullSink, ProgressSink, format_duration
from peagle.spec import HELDOUT_PROMPT_SET

if TYPE_CHECKING:
    from peagle.eval.parity import ParityResult

__all__ = ["EVAL_DTYPES", "PARITY_SET", "reference_dtypes", "run_eval"]

#: `--dtype` values of `peagle eval`: `auto` = what the job's own evaluation uses (below).
EVAL_DTYPES = ("auto", "float32", "bfloat16")

#: Seconds between two "still running" lines while a vLLM probe runs and says nothing new.
HEARTBEAT_S = 15.0

#: The probe's progress lines in its log (`peagle.engine.probe.PROGRESS_PREFIX`; the probe imports no peagle).
PROBE_PREFIX = "peagle-probe: "

#: The name of the parity record's prompt set among the sets vLLM measures.
PARITY_SET = "(parity.json)"

#: What a report drops when it is printed (token ids of every output).
_BULKY = ("outputs", "counters", "histograms")


def reference_dtypes(export_config: dict[str, Any], dtype: str) -> tuple[Any, Any]:
    """(target dtype, draft dtype) of a reference evaluation of an export.

    `auto` is what the evaluation inside a job does (`peagle.eval.final.evaluate_export`): the target in the
    dtype the export is served in (its config's `torch_dtype`, bf16: about 3x faster than fp32 on a CPU
    with bf16 instructions, and what vLLM runs), the draft in fp32 (`load_exported_draft`'s default).
    `float32` / `bfloat16` put both in that dtype.

    Raises:
        ValueError: any other `dtype`.
    """
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return names.get(str(export_config.get("torch_dtype")), torch.float32), torch.float32
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EVAL_DTYPES)}, got {dtype!r}")
    return names[dtype], names[dtype]


def _slim(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in _BULKY}


@contextlib.contextmanager
def _heartbeat(sink: ProgressSink, what: str, *, every_s: float, log: Path | None = None) -> Iterator[None]:
    """While the block runs (a thread): the probe's progress lines (`peagle-probe: ...` in `log`, each K,
    round and batch size of a sweep) as they come, and `what: running for 1m15s` when nothing was said
    for `every_s` seconds."""
    stop = threading.Event()
    t0 = last = time.monotonic()
    offset = 0

    def probe_lines() -> list[str]:
        nonlocal offset
        if log is None or not log.is_file():
            return []
        with log.open("rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only
        offset += end
        text = chunk[:end].decode("utf-8", errors="replace")
        return [line[len(PROBE_PREFIX):] for line in text.splitlines() if line.startswith(PROBE_PREFIX)]

    def beat() -> None:
        nonlocal last
        while not stop.wait(min(1.0, every_s)):
            now = time.monotonic()
            for line in probe_lines():
                sink.log("info", f"{what}: {line}")
                last = now
            if now - last >= every_s:
                sink.log("info", f"{what}: running for {format_duration(now - t0)}")
                last = now

    thread = threading.Thread(target=beat, name="peagle-eval-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _speedup_text(plan: SpeedupPlan) -> str:
    ks = f"K={plan.ks[0]}" if len(plan.ks) == 1 else f"K={plan.ks[0]}..{plan.ks[-1]} (one engine start each)"
    return f"serving speedup at {ks}, batch sizes {plan.batch_sizes}, {plan.rounds} rounds"


def run_eval(
    export_dir: str | Path,
    *,
    prompts: str | Sequence[str],
    num_prompts: int,
    max_new_tokens: int,
    num_speculative_tokens: int | None = None,
    engine: str = "reference",
    target: str | None = None,
    dtype: str = "auto",
    speedup: SpeedupPlan | None = None,
    sink: ProgressSink | None = None,
    heartbeat_s: float = HEARTBEAT_S,
) -> dict[str, Any]:
    """AL of an export per prompt set with the reference decoder, vLLM, or both (what `peagle eval` prints).

    Args:
        export_dir: a validated export directory.
        prompts: one or several of `humaneval`, `sharegpt-heldout`, a JSONL path.
        num_prompts, max_new_tokens: first N prompts of each set, tokens per prompt.
        num_speculative_tokens: K; None = the export's `speculative_tokens`.
        engine: `reference`, `vllm` or `both` (both adds the comparison on the first set).
        target: target folder for both engines; None = the export's verifier, mapped to this machine by
            `peagle.builtin.local_verifier`.
        dtype: reference decoder dtypes, `auto` (as inside a job), `float32` or `bfloat16`
            (`reference_dtypes`).
        speedup: also time the verifier alone against it with the draft in vLLM on the first set
            (`peagle.eval.speedup.plan_speedup`); needs `engine` vllm or both.
        sink: where progress goes (log lines, one `progress` event per prompt set); None = nowhere.
        heartbeat_s: seconds between two "still running" lines while the vLLM probe runs.

    Returns:
        `{"engine", "acceptance_length", "per_position", "per_request_spread", "tokens_generated",
        "num_drafts", ...}` of the first set at top level, `prompt_sets` (every set), `serving` (the
        speedup report, with `speedup`); with `both`, the reference numbers at top level plus `"vllm"` and
        `"comparison"`; with vLLM, `parity` (`ParityResult.to_dict()`, None when the export has no record).

    Raises:
        ValueError: `speedup` without vLLM, or an unknown `dtype`.
        TargetLoadError: no loadable target.
    """
    from transformers import AutoTokenizer

    from peagle.data.prompts import PromptSources, prompt_set_ids, run_heldout_prompts
    from peagle.errors import TargetLoadError
    from peagle.eval.serve_check import compare_reports
    from peagle.export.writer import check_export, num_speculative_tokens_of, read_export_config

    if speedup is not None and engine not in ("vllm", "both"):
        raise ValueError("--speedup measures vLLM serving: use --engine vllm (or both)")
    out_sink: ProgressSink = sink if sink is not None else NullSink()
    names = [prompts] if isinstance(prompts, str) else list(prompts)
    check_export(export_dir)
    cfg = read_export_config(export_dir)
    k = num_speculative_tokens or num_speculative_tokens_of(cfg)
    tpath = _target_path(cfg, target)
    dtypes = reference_dtypes(cfg, dtype)
    out_sink.log("info", f"evaluating {export_dir} against {tpath} ({engine})")
    try:
        tok = AutoTokenizer.from_pretrained(str(tpath))
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"target {tpath!r} cannot be loaded: {str(exc).splitlines()[0]}") from None
    sources = PromptSources(heldout=run_heldout_prompts(export_dir, num_prompts)) \
        if HELDOUT_PROMPT_SET in names else None
    sets = {name: prompt_set_ids(name, num_prompts, tok, sources) for name in names}
    first = names[0]
    out: dict[str, Any] = {"prompts": first, "num_prompts": len(sets[first]), "max_new_tokens": max_new_tokens}
    ref: dict[str, dict[str, Any]] = {}
    if engine in ("reference", "both"):
        ref = _reference_reports(export_dir, tpath, sets, k=k, max_new_tokens=max_new_tokens, dtypes=dtypes,
                                 sink=out_sink)
        out.update({"engine": "reference", **_slim(ref[first])})
        out["prompt_sets"] = {name: _slim(r) for name, r in ref.items()}
    if engine in ("vllm", "both"):
        res, facts, parity = _vllm_reports(export_dir, tpath, sets, k=k, max_new_tokens=max_new_tokens,
                                           speedup=speedup, sink=out_sink, heartbeat_s=heartbeat_s)
        v_first = {**facts, **_slim(res["prompt_sets"][first])}
        if not ref:
            out.update(v_first)
            out["prompt_sets"] = {name: _slim(r) for name, r in res["prompt_sets"].items()}
        else:
            out["vllm"] = {**v_first, "prompt_sets": {name: _slim(r) for name, r in res["prompt_sets"].items()}}
            out["comparison"] = compare_reports(ref[first], {**facts, **res["prompt_sets"][first]})
        out["serving"] = res["serving"]
        out["parity"] = parity.to_dict() if parity is not None else None
    return out


def _target_path(export_config: dict[str, Any], target: str | None) -> str | Path:
    """The target both engines load: `target`, else the export's verifier mapped to this machine
    (`peagle.builtin.local_verifier`).

    Raises:
        TargetLoadError: no `target` and the export names no verifier, or its verifier is not here.
    """
    from peagle.builtin import local_verifier
    from peagle.errors import TargetLoadError
    from peagle.export.writer import verifier_of

    verifier = verifier_of(export_config)
    if not (target or verifier):
        raise TargetLoadError("no target: pass --target (the export names no verifier)")
    try:  # the export names a portable verifier; this machine loads its local folder
        return target or local_verifier(str(verifier))
    except (ValueError, FileNotFoundError) as exc:
        raise TargetLoadError(f"verifier {verifier!r} cannot be loaded here: {exc}; pass --target") from None


def _reference_reports(export_dir: str | Path, tpath: str | Path, sets: dict[str, list[list[int]]], *, k: int,
                       max_new_tokens: int, dtypes: tuple[Any, Any], sink: ProgressSink) -> dict[str, dict[str, Any]]:
    """The reference decoder's report of each prompt set (`peagle.eval.reference.evaluate_prompts`, outputs
    included), with the target and the draft in `dtypes` = (target dtype, draft dtype); one `progress` event
    per set.

    Raises:
        TargetLoadError: the target does not load.
    """
    from transformers import AutoModelForCausalLM

    from peagle.errors import TargetLoadError
    from peagle.eval.reference import evaluate_prompts
    from peagle.export.writer import load_exported_draft

    target_dtype, draft_dtype = dtypes
    try:
        model = AutoModelForCausalLM.from_pretrained(str(tpath), dtype=target_dtype).eval()
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"target {tpath!r} cannot be loaded: {str(exc).splitlines()[0]}") from None
    draft = load_exported_draft(export_dir, dtype=draft_dtype, validate=False)
    eos = model.generation_config.eos_token_id
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    ref: dict[str, dict[str, Any]] = {}
    for i, (name, ids) in enumerate(sets.items()):
        sink.log("info", f"reference decoder: prompt set {name} ({len(ids)} prompts, K={k}, "
                         f"{max_new_tokens} new tokens each)")
        rep = evaluate_prompts(model, draft, ids, num_speculative_tokens=k, max_new_tokens=max_new_tokens,
                               eos_token_ids=eos_ids)  # fmt: skip
        ref[name] = {"engine": "reference", **rep.to_dict(with_outputs=True)}
        sink.event("progress", phase="evaluating", step=i + 1, total_steps=len(sets))
        sink.log("info", f"reference decoder: prompt set {name}: acceptance_length "
                         f"{ref[name].get('acceptance_length')}")
    return ref


def _vllm_reports(
    export_dir: str | Path, tpath: str | Path, sets: dict[str, list[list[int]]], *, k: int, max_new_tokens: int,
    speedup: SpeedupPlan | None, sink: ProgressSink, heartbeat_s: float,
) -> tuple[dict[str, Any], dict[str, Any], ParityResult | None]:
    """vLLM's measurement of the prompt sets (`peagle.eval.serve_check.measure_vllm`, with `speedup` the
    serving speedup too) and the served-parity gate on the export's parity record (None without one).

    Returns:
        (the measurement: `prompt_sets` and `serving`, the measurement's facts without them, the parity check).
    """
    from peagle.eval.parity import PARITY_FILE, check_parity, read_parity
    from peagle.eval.serve_check import measure_vllm, run_vllm_probe

    what = f"vLLM: AL on {', '.join(sets)} at K={k}" + (f", {_speedup_text(speedup)}" if speedup else "")
    record = read_parity(export_dir)
    # the record's prompts ride along in the same engine start when its settings are the asked ones
    same = record is not None and (int(record["num_speculative_tokens"]), int(record["max_new_tokens"])) \
        == (k, max_new_tokens)
    measured = {**sets, PARITY_SET: [list(p) for p in record["prompts"]]} if same and record else sets
    sink.log("info", f"{what}: starting the engines")
    with tempfile.TemporaryDirectory(prefix="peagle-eval-") as tmp:  # the probe's log, read as it grows
        log = Path(tmp) / "vllm.log"
        with _heartbeat(sink, "vLLM probe", every_s=heartbeat_s, log=log):
            res = measure_vllm(export_dir, measured, max_new_tokens=max_new_tokens, num_speculative_tokens=k,
                               speedup=speedup, verifier=tpath, log_path=log)  # fmt: skip
            facts = {k_: v for k_, v in res.items() if k_ not in ("prompt_sets", "serving")}
            if record is None:
                parity = None
                sink.log("info", f"served parity not checked: {export_dir} has no {PARITY_FILE} (written "
                                 "by a job's evaluation with the reference decoder)")  # fmt: skip
            else:
                if same:
                    on_record = {**facts, **res["prompt_sets"].pop(PARITY_SET)}
                else:
                    sink.log("info", f"served parity: the recorded prompts at the recorded K="
                                     f"{record['num_speculative_tokens']}, {record['max_new_tokens']} new "
                                     "tokens (another engine start)")  # fmt: skip
                    on_record = run_vllm_probe(
                        export_dir, [list(p) for p in record["prompts"]],
                        max_new_tokens=int(record["max_new_tokens"]),
                        num_speculative_tokens=int(record["num_speculative_tokens"]), verifier=tpath, log_path=log)
                parity = check_parity(record, on_record)
                if not parity.fails:  # a failure is the error line `peagle eval` ends with
                    sink.log("info" if parity.ok else "warning", parity.message)
    sink.log("info", "vLLM: done")
    return res, facts, parity
