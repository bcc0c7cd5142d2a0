"""The evaluation end of a training run (`peagle.pipeline.run_pipeline` after `trainer.train()`).

    evaluate_run(spec, run, result, model=model, tok=tok, k=k, sink=sink, target_path=path, step=s, total_steps=n)

The decoder is `peagle.eval.decoder.measuring_engine`'s (the resolved `eval.engine`).
1. `evaluating`: the best checkpoint (`checkpoints/state.json`; ranked by `checkpoints.select_best_by`,
   resolved) is measured on every prompt set; with vLLM, in the same engine start, the serving speedup
   (`eval.speedup`: verifier alone vs with the draft, K = 1..trained K, batch 1 / all prompts / the
   user's sizes) and the recommended K per batch size. An `eval` event names `checkpoint_step`, carrying
   the float metrics and an `evaluation` object (engine, per-set AL with per-request spread, serving
   report, hardware) that the service stores on that checkpoint.
2. `exporting`: RUN/export = the best checkpoint's config.json + model.safetensors, plus eval.json
   (`publish_export`).
   With the reference decoder, RUN/export/parity.json records its acceptance per draft position on the first
   set with the prompts' token ids, K and max_new_tokens (`peagle.eval.parity.parity_record`); the `eval`
   event's evaluation carries it without the prompts (`parity_reference`). The record is also written into
   the best checkpoint's folder, and the `eval` event's `files` lists it (path, size, sha256): the service
   adds it to that checkpoint's files, so a downloaded checkpoint carries it too (docs/export.md 7).
3. `serve_check` (reference engine with `eval.serve_check`): vLLM loads RUN/export with parallel drafting,
   measures the recorded prompts (and the speedup) and is compared with the reference decoder; the
   served-parity gate (`peagle.eval.parity.check_parity`) fails the phase with `ServedParityError`
   (exit code 12, `served_parity_failed`) when vLLM accepts clearly less at some position, after the
   comparison (serve_check.json, the `eval` event) is recorded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from peagle.data.prompts import PromptSources, prompt_ids
from peagle.errors import CheckpointError, ResourceError, ServedParityError
from peagle.eval.decoder import al_str, decoder_name, eos_ids, measuring_engine, resolved_eval
from peagle.eval.parity import PARITY_FILE, check_parity, parity_record, parity_summary, read_parity
from peagle.fileio import atomic_write_json, publish_dir
from peagle.progress import ProgressSink
from peagle.run_folder import CHECKPOINTS, EXPORT, is_complete, step_of
from peagle.spec import TrainSpec
from peagle.spec.metrics import ACCEPTANCE_LENGTH, PER_POSITION, TAU_SIM, al_pos_values, eval_key

__all__ = ["al_text", "attach_parity", "best_checkpoint", "evaluate_export", "evaluate_run", "evaluation_summary", "publish_export",
           "reference_parity", "serve_check"]

#: Report fields left out of events and eval.json (token ids of every output, raw counters, per-request
#: histograms, the reference decoder's outputs and histograms kept for the parity record).
_BULKY = ("outputs", "counters", "histograms", "reference_requests")


def best_checkpoint(root: Path) -> Path:
    """The best complete checkpoint of RUN/checkpoints (else the latest complete one).

    Raises:
        CheckpointError: none is complete.
    """
    from peagle.train.checkpoint import read_state

    state = read_state(root)
    for name in (state.get("best"), state.get("latest")):
        if name and is_complete(root / name):
            return root / name
    raise CheckpointError(f"{root}: no complete checkpoint to export")


def _slim(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in _BULKY}


def _speedup_plan(spec: TrainSpec, k: int, num_prompts: int) -> Any:
    from peagle.eval.speedup import plan_speedup

    e = spec.eval
    if not e.speedup or num_prompts == 0:
        return None
    return plan_speedup(k, min(e.speedup_num_prompts, num_prompts), sweep=e.speedup_sweep,
                        batch_sizes=e.speedup_batch_sizes, rounds=e.speedup_rounds)  # fmt: skip


def _serving_summary(serving: dict[str, Any] | None, default_k: int) -> dict[str, Any] | None:
    """The serving report as the checkpoint keeps it: rounds' passes left out, the recommended
    `--speculative-config` added (its `model` is filled in by whoever names the folder)."""
    from peagle.eval.speedup import speculative_config

    if not serving:
        return None
    out = {k: v for k, v in serving.items() if k != "checks"}
    out["recommended_speculative_config"] = speculative_config("", serving.get("recommended") or [], default_k)
    out["parallel_drafting_ok"] = all(not c.get("problems") for c in (serving.get("checks") or {}).values())
    out["summary"] = _serving_text(out)
    return out


def evaluate_export(
    spec: TrainSpec, ckpt: Path, model: Any, tok: Any, k: int, sink: ProgressSink, *, target_path: Path | str,
    sources: PromptSources | None = None,
) -> dict[str, Any]:
    """AL of a checkpoint's export on every prompt set (and, with vLLM, the serving speedup).

    Returns:
        `{tau_sim, engine, acceptance_length, per_position, per_request_spread, tokens_generated,
        num_speculative_tokens, prompt_sets: {name: report}, serving: report | None, ...engine facts}`;
        the top-level AL is the first set's.
    """
    resolved = resolved_eval(spec)
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    metrics = meta.get("metrics", {})
    out: dict[str, Any] = {TAU_SIM: metrics.get(eval_key(TAU_SIM), metrics.get(TAU_SIM))}
    sets = prompt_ids(resolved, tok, sources)
    engine = measuring_engine(resolved, model, sink)
    out["engine"] = engine
    reports: dict[str, dict[str, Any]] = {}
    if engine == "reference":
        from peagle.eval.reference import evaluate_prompts
        from peagle.export.writer import load_exported_draft

        draft = load_exported_draft(ckpt).to(next(model.parameters()).device)
        for name, prompts in sets:
            rep = evaluate_prompts(model, draft, prompts, num_speculative_tokens=k,
                                   max_new_tokens=resolved.eval.max_new_tokens, eos_token_ids=eos_ids(model, tok))
            reports[name] = {"engine": "reference", **rep.to_dict()}
            out.setdefault("reference_requests", {})[name] = {"outputs": rep.outputs, "histograms": rep.histograms}
    elif sets:
        from peagle.eval.serve_check import measure_vllm

        def measure(plan: Any) -> dict[str, Any]:
            return measure_vllm(ckpt, dict(sets), max_new_tokens=resolved.eval.max_new_tokens,
                                num_speculative_tokens=k, speedup=plan, verifier=target_path)

        plan = _speedup_plan(resolved, k, len(sets[0][1]))
        try:
            res = measure(plan)
        except ResourceError as exc:
            if plan is None:
                raise
            # the AL is the job's evaluation; the speedup (a second engine, K engine starts) must not cost it
            sink.event("warning", message=f"serving speedup not measured: {exc}")
            res = measure(None)
        reports = {name: _slim(r) for name, r in res["prompt_sets"].items()}
        out.update({key: res.get(key) for key in ("parallel_drafting_ok", "problems", "hardware", "vllm_version")})
        out["serving"] = _serving_summary(res.get("serving"), k)
    for name, r in reports.items():
        n = len(dict(sets)[name])
        sink.log("info", f"{name} ({n} prompts, {decoder_name(engine)}): AL {al_str(r.get(ACCEPTANCE_LENGTH))}, "
                         f"acceptance per draft position {[round(x, 2) for x in r.get(PER_POSITION) or []]}")
    if reports:
        first = next(iter(reports.values()))
        out.update({key: first.get(key) for key in (ACCEPTANCE_LENGTH, PER_POSITION, "per_request_spread",
                                                     "tokens_generated")})
        out["num_speculative_tokens"] = k
    out["prompt_sets"] = reports
    if out.get("serving"):
        sink.log("info", out["serving"]["summary"])
    return out


def _serving_text(serving: dict[str, Any]) -> str:
    """`served speedup (vLLM, cpu AMD EPYC x2, K=4): batch 1 1.07x faster, batch 8 0.45x (2.22x slower); ...`."""
    from peagle.eval.speedup import speedup_text

    hw = serving.get("hardware") or {}
    where = hw.get("gpu") or f"{hw.get('cpu')} x{hw.get('cpu_count')}"
    parts = []
    for key in ("batch_1", "batch_n"):
        row = serving.get(key)
        if row:
            parts.append(f"batch {row['batch_size']} {speedup_text(row['speedup'])} "
                         f"({row['base_tokens_per_s']:.1f} -> {row['spec_tokens_per_s']:.1f} tokens/s)")
    rec = "; ".join(f"batch {r['batch_size']}: " + (f"K={r['num_speculative_tokens']}" if r["num_speculative_tokens"]
                                                      else "no draft (slower at every K)")
                    for r in serving.get("recommended") or [])  # fmt: skip
    return (f"served speedup (vLLM on {hw.get('device')} {where}, K={serving.get('num_speculative_tokens')}, "
            f"AL {al_str(serving.get(ACCEPTANCE_LENGTH))}): {', '.join(parts)}; recommended {rec}")


def evaluation_summary(ev: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of an evaluation (the service's `evaluation` column): engine, per-set AL with
    its spread, the serving report and the hardware; no per-request lists."""
    sets = {name: {k: v for k, v in r.items() if k in (ACCEPTANCE_LENGTH, PER_POSITION, "per_request_spread",
                                                       "num_drafts", "num_prompts", "tokens_generated", "engine")}
            for name, r in (ev.get("prompt_sets") or {}).items()}  # fmt: skip
    out = {"engine": ev.get("engine"), "num_speculative_tokens": ev.get("num_speculative_tokens"),
           "prompt_sets": sets, "serving": ev.get("serving")}
    for key in ("hardware", "vllm_version", "parallel_drafting_ok"):
        if ev.get(key) is not None:
            out[key] = ev[key]
    return out


def al_text(ev: dict[str, Any], spec: TrainSpec) -> str:
    """`AL 1.23 (reference decoder, humaneval, 8 prompts)`: the measured AL of an eval, rounded for people."""
    al = ev.get(ACCEPTANCE_LENGTH)
    if not isinstance(al, int | float):
        return "AL not measured (no eval.prompt_sets)" if not spec.eval.prompt_sets else "AL not measured (no drafts)"
    first = spec.eval.prompt_sets[0] if spec.eval.prompt_sets else None
    where = f", {first.name}, {first.num_prompts} prompts" if first else ""
    return f"AL {al:.2f} ({decoder_name(str(ev.get('engine') or 'reference'))}{where})"


def publish_export(ckpt: Path, dest: Path) -> Path:
    """RUN/export = the checkpoint's config.json + model.safetensors, checked, published atomically."""
    from peagle.export.writer import check_export

    with publish_dir(dest, tmp_name=dest.name + ".tmp") as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(ckpt / name, tmp / name)
        check_export(tmp)
    return dest


def reference_parity(
    spec: TrainSpec, ev: dict[str, Any], ckpt: Path, tok: Any, k: int, sources: PromptSources | None = None, *,
    target_dtype: str | None = None,
) -> dict[str, Any] | None:
    """The parity record (`peagle.eval.parity.parity_record`) of a reference evaluation (`evaluate_export`
    with the reference decoder): its first prompt set, those prompts' token ids, K and max_new_tokens, and
    the verifier the checkpoint's config names. None when no set was measured."""
    from peagle.export.writer import read_export_config, verifier_of

    sets = prompt_ids(spec, tok, sources, first_only=True) if spec.eval.prompt_sets else []
    if not sets:
        return None
    name, prompts = sets[0]
    report = (ev.get("prompt_sets") or {}).get(name)
    if not report or not report.get("num_drafts"):
        return None
    report = {**report, **(ev.get("reference_requests") or {}).get(name, {})}  # outputs, histograms
    return parity_record(report, prompt_set=name, prompts=prompts, num_speculative_tokens=k,
                         max_new_tokens=spec.eval.max_new_tokens, checkpoint=ckpt.name,
                         verifier=verifier_of(read_export_config(ckpt)), target_dtype=target_dtype)  # fmt: skip


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, data, indent=2, sort_keys=True, default=str, newline=True)


def attach_parity(ckpt: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write the parity record into checkpoint folder `ckpt` (atomically) so its download carries it.

    Returns:
        its checkpoint file entry `{path, size, sha256}` (the format of a `checkpoint` event's `files`).
    """
    path = ckpt / PARITY_FILE
    _write_json(path, record)
    data = path.read_bytes()
    return {"path": PARITY_FILE, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def serve_check(
    spec: TrainSpec, export_dir: Path, tok: Any, k: int, sink: ProgressSink, target_path: Path | str,
    sources: PromptSources | None = None,
) -> dict[str, Any] | None:
    """vLLM on RUN/export against the reference decoder's eval.json (first prompt set), plus the serving
    speedup (`eval.speedup`); an `eval` event with `vllm_*` metrics and the `evaluation` part it adds,
    naming `checkpoint_step`. None (with a warning event) when vLLM is missing or failed."""
    from peagle.eval.serve_check import compare_reports, measure_vllm, vllm_python

    if vllm_python() is None:
        sink.event("warning", message="serve check skipped: vLLM is not installed (make vllm-env)")
        return None
    eval_json = json.loads((export_dir / "eval.json").read_text(encoding="utf-8"))
    record = read_parity(export_dir)
    max_new = spec.eval.max_new_tokens
    if record is not None:  # the recorded prompts and settings: what the gate compares with
        name, prompts = str(record["prompt_set"]), [list(p) for p in record["prompts"]]
        k, max_new = int(record["num_speculative_tokens"]), int(record["max_new_tokens"])
    else:
        name, prompts = prompt_ids(spec, tok, sources, first_only=True)[0]
    plan = _speedup_plan(spec, k, len(prompts))
    try:  # vLLM loads the folder the run trained against; the export names it portably
        res = measure_vllm(export_dir, {name: prompts}, max_new_tokens=max_new,
                           num_speculative_tokens=k, speedup=plan, verifier=target_path)  # fmt: skip
    except ResourceError as exc:
        sink.event("warning", message=f"serve check failed: {exc}")
        return None
    facts = {key: v for key, v in res.items() if key not in ("prompt_sets", "serving")}
    vllm = {**facts, **res["prompt_sets"][name]}
    ref = dict(eval_json.get("prompt_sets", {}).get(name, {}))
    cmp = compare_reports(ref, vllm)
    serving = _serving_summary(res.get("serving"), k)
    cmp["serving"] = serving
    parity = check_parity(record, vllm) if record is not None else None
    cmp["parity"] = parity.to_dict() if parity is not None else None
    _write_json(export_dir / "serve_check.json", cmp)
    v_al, r_al = cmp["vllm"].get(ACCEPTANCE_LENGTH), cmp["reference"].get(ACCEPTANCE_LENGTH)
    sink.event(
        "eval",
        message=f"vLLM serve check ({name}, {len(prompts)} prompts): AL {al_str(v_al)} in vLLM vs {al_str(r_al)} in "
        f"the reference decoder, parallel drafting {'on' if res.get('parallel_drafting_ok') else 'NOT on'}",
        # `checkpoint_step`: the service records vLLM's AL on the checkpoint, next to the reference AL
        checkpoint_step=step_of(str(eval_json.get("checkpoint", ""))),
        # Keys prefixed `vllm_`: the reference decoder's `acceptance_length` stays the job's AL metric.
        metrics={"engine": "vllm", **{f"vllm_{key}": v for key, v in cmp["vllm"].items()},
                 "al_ratio_vllm_over_reference": cmp["al_ratio_vllm_over_reference"]},
        evaluation={"serving": serving, "vllm": {key: cmp["vllm"].get(key) for key in (
            ACCEPTANCE_LENGTH, PER_POSITION, "per_request_spread", "parallel_drafting_ok", "vllm_version")},
            "hardware": res.get("hardware"), "parity": cmp["parity"]},
    )
    if serving:
        sink.log("info", serving["summary"])
    if not res.get("parallel_drafting_ok"):
        sink.event("warning", message="vLLM did not run the export with parallel drafting: "
                                      + "; ".join(res.get("problems") or []))  # fmt: skip
    if parity is None:
        sink.event("warning", message=f"served parity not checked: RUN/export has no {PARITY_FILE} (the reference "
                                      "decoder did not measure this run)")  # fmt: skip
    elif parity.fails:
        raise ServedParityError(parity.message)
    elif not parity.ok:
        sink.event("warning", message=parity.message)
    else:
        sink.log("info", parity.message)
    return cmp


def evaluate_run(
    spec: TrainSpec, run: Path, result: Any, *, model: Any, tok: Any, k: int, sink: ProgressSink,
    target_path: Path | str, step: int, total_steps: int, sources: PromptSources | None = None,
) -> None:
    """Steps 1-3 of the module docstring on RUN; fills `result` (`PipelineResult`: best_checkpoint, eval,
    export_dir, serve_check) and announces the phases (`done` last)."""
    resolved = resolved_eval(spec)
    best = best_checkpoint(run / CHECKPOINTS)
    result.best_checkpoint = best.name
    engine = measuring_engine(resolved, model, None)
    what = "acceptance length and serving speedup" if engine == "vllm" and resolved.eval.speedup else \
        "acceptance length"
    sink.event("phase", phase="evaluating", message=f"{what} of {best.name} ({decoder_name(engine)}, K={k})")
    result.eval = evaluate_export(resolved, best, model, tok, k, sink, target_path=target_path, sources=sources)
    if result.eval.get(ACCEPTANCE_LENGTH) is not None:
        values = {ACCEPTANCE_LENGTH: result.eval[ACCEPTANCE_LENGTH], **al_pos_values(result.eval.get(PER_POSITION, []))}
        sink.metric(step, step / max(total_steps, 1) * resolved.optim.epochs, values)
    record = reference_parity(resolved, result.eval, best, tok, k, sources,
                              target_dtype=str(next(model.parameters()).dtype).removeprefix("torch.")) \
        if engine == "reference" else None
    evaluation = evaluation_summary(result.eval)
    added: dict[str, Any] = {}
    if record is not None:
        evaluation["parity_reference"] = parity_summary(record)
        added["files"] = [attach_parity(best, record)]  # added to the checkpoint's file list
    # `checkpoint_step` lets the service record this AL (and the evaluation) on the evaluated checkpoint.
    sink.event("eval", metrics=_slim(result.eval), checkpoint=best.name, checkpoint_step=step_of(best.name),
               evaluation=evaluation, **added)

    sink.event("phase", phase="exporting", message="RUN/export = the best checkpoint's vLLM export")
    export_dir = publish_export(best, run / EXPORT)
    _write_json(export_dir / "eval.json", {"checkpoint": best.name, **_slim(result.eval)})
    if record is not None:
        _write_json(export_dir / PARITY_FILE, record)
    result.export_dir = export_dir
    sink.event("export", dir=EXPORT, checkpoint=best.name, message=f"exported {best.name} to RUN/export")

    if engine == "reference" and resolved.eval.serve_check:
        sink.event("phase", phase="serve_check", message="loading the export in vLLM with parallel drafting")
        result.serve_check = serve_check(resolved, export_dir, tok, k, sink, target_path, sources)
    sink.event("phase", phase="done", message=f"done: {al_text(result.eval, resolved)} ({best.name})")
