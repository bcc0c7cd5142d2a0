"""The dry-run answer (`POST /v1/jobs?dry_run=true`): `estimate` puts the funnel, the phase models and the
history together, with the basis and the accuracy it states.

Each phase takes the rates of the newest `calibration.HISTORY_JOBS` comparable earlier jobs when there are
any (`rates.rates_from_history`; error at least `HISTORY_MIN_ERROR`, else their spread), else the
calibrated model (`phases.model_phases`, within `MODEL_RANGE`). The notes say what was assumed, how many
jobs are ahead on the queue and when the first training curve comes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from peagle.spec import TrainSpec
from peagle.spec.funnel import READ
from peagle.spec.hardware import DeviceFacts, cpu_facts
from peagle.spec.preview import preview_off_reason, preview_spec
from service.estimate.calibration import (
    AVG_TOKENS_PER_ROW,
    CALIBRATION_CLASS,
    HIDDEN,
    HISTORY_JOBS,
    HISTORY_MIN_ERROR,
    MODEL_RANGE,
    PHASE_GROUPS,
    spec_hardware,
)
from service.estimate.funnel import data_funnel, optimizer_steps
from service.estimate.phases import (
    PhaseModel,
    PreviewModel,
    feature_bytes_per_token,
    model_phases,
    preview_model,
)
from service.estimate.rates import Comparable, Measured, PhaseRate, measured_rates, rates_from_history

__all__ = ["estimate"]


def estimate(spec: TrainSpec, *, dataset_rows: dict[str, dict[str, Any]], queue: str, queue_position: int,
             history: Sequence[Measured] = (), vllm_available: bool | None = None, queue_running: int = 0,
             cpu_flags: frozenset[str] | None = None) -> dict[str, Any]:
    """The data funnel, steps, per-phase and total wall time of `spec`, with its basis and accuracy.

    Args:
        spec: a validated spec.
        dataset_rows: `dataset:<id>` -> that dataset's validation report (its funnel, tokens if known).
        queue: the queue the job would go to.
        queue_position: jobs ahead of it on `queue`: running there now and queued (`repo.queue_ahead`).
        queue_running: how many of those run now.
        history: earlier succeeded jobs on `queue`, newest first (`api.history`); only the newest
            `HISTORY_JOBS` comparable to this one (`Comparable`) are used.
        vllm_available: whether the workers can run the vLLM target engine (resolves `target_engine: auto`).
        cpu_flags: the workers' CPU flags (default: this host's, which the workers share in docker-compose).
    """
    notes: list[str] = []
    flags = cpu_facts().cpu_flags if cpu_flags is None else cpu_flags
    # estimate what the worker will run: the engines resolved (when known) and `target.dtype: auto` by what
    # the CPU runs natively
    spec = spec.resolve(cuda_available=spec.resources.gpus > 0, vllm_available=vllm_available,
                        device_facts=DeviceFacts(cpu_flags=flags))
    hw = spec_hardware(spec, flags)
    fun = data_funnel(spec, dataset_rows, notes)
    steps = optimizer_steps(spec, fun["packed_rows"] or 0)
    o = spec.optim
    per_token, dump, hidden_bytes = _feature_bytes(spec, fun, notes)
    pv_on = spec.preview.conversations > 0 and preview_off_reason(spec) is None
    pv_funnel = data_funnel(preview_spec(spec), dataset_rows, []) if pv_on else None
    model = model_phases(spec, read=fun[READ], steps=steps, packed_rows=fun["packed_rows"] or 0, hardware=hw,
                         preview_funnel=pv_funnel)
    key = Comparable.of(spec.model_dump(mode="json"), hw)
    used = [m for m in history if m.key == key][:HISTORY_JOBS]
    rates: dict[str, list[PhaseRate]] = {k: [] for k in PHASE_GROUPS}
    for m in used:
        for phase, r in measured_rates(m).items():
            rates[phase].append(r)
    measured = rates_from_history(model, rates)
    phases, lo, hi, worst = _combine(model, measured)
    accuracy, basis = _accuracy(spec, hw, queue=queue, model=model, measured=measured, used=used,
                                history=history, key=key, worst=worst)
    if queue_position:
        notes.append(f"{queue_position} job{'s' if queue_position > 1 else ''} ahead on queue {queue}: "
                     f"{queue_running} running, {queue_position - queue_running} queued; it starts when a worker "
                     "of the queue is free")
    first_curve = _first_curve_seconds(spec, model, phases, steps, preview_model(spec, hardware=hw,
                                                                                 funnel_=pv_funnel))
    off = preview_off_reason(spec)
    if pv_on:
        notes.append(f"first training curve after about {_minutes(first_curve)}: a preview of "
                     f"{spec.preview.steps} steps on the first {spec.preview.conversations} conversations, "
                     "before the main run (phase preview)")
    else:
        if off is not None:
            notes.append(f"no preview: {off}")
        notes.append(f"first training curve after about {_minutes(first_curve)} (when training starts)")
    notes.append("the job page shows the measured step rate and time left once training runs")
    return {
        "rows": fun["train_conversations"],
        "tokens": fun["train_tokens"],
        "optimizer_steps": steps,
        "tokens_per_step": o.pack_length * o.micro_batch_size * o.grad_accumulation,
        "hidden_state_bytes": hidden_bytes,
        "feature_bytes_per_token": per_token,
        "offline_dump_bytes": dump,
        "target_engine": spec.resources.target_engine,
        "target_dtype": spec.target.dtype,
        "wall_clock_seconds": round(sum(phases.values()), 1),
        "wall_clock_range_seconds": [round(lo, 1), round(hi, 1)],
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "first_curve_s": round(first_curve, 1),
        "basis": basis,
        "history_jobs": len(used),
        "accuracy": accuracy,
        "funnel": fun,
        "queue": queue,
        "queue_position": queue_position,
        "queue_running": queue_running,
        "notes": notes,
    }


def _feature_bytes(spec: TrainSpec, fun: Mapping[str, Any], notes: list[str]) -> tuple[int, int, int]:
    """(feature bytes per token, the offline dump's bytes, the features on disk at once) of a resolved
    `spec` whose data funnel is `fun`; an unknown target's hidden size is assumed (4096) and noted."""
    hidden = HIDDEN.get(spec.target.model)
    if hidden is None:
        hidden = HIDDEN["8b"]
        notes.append("target hidden size unknown before loading its config: assumed 4096")
    per_token = feature_bytes_per_token(spec, hidden)
    dump = (fun["train_tokens"] + spec.data.eval_samples * AVG_TOKENS_PER_ROW) * per_token
    if spec.resources.capture == "offline":
        hidden_bytes = dump
    elif spec.resources.target_engine == "vllm":  # streamed: the engine runs ahead within feature_disk_gb
        hidden_bytes = min(dump, int(spec.resources.feature_disk_gb * 1e9))
    else:
        hidden_bytes = 0
    return per_token, dump, hidden_bytes


def _combine(model: Mapping[str, PhaseModel], measured: Mapping[str, tuple[float, float]]
             ) -> tuple[dict[str, float], float, float, float]:
    """(seconds per phase, the total's low and high bound, the worst history factor): a measured phase
    from its history (error at least `HISTORY_MIN_ERROR`), any other from the model within `MODEL_RANGE`."""
    phases: dict[str, float] = {}
    lo = hi = 0.0
    worst = 1.0
    for phase, p in model.items():
        if phase in measured:
            secs, spread = measured[phase]
            err = max(HISTORY_MIN_ERROR, spread - 1.0)
            worst = max(worst, 1.0 + err)
            phases[phase], lo, hi = secs, lo + secs / (1 + err), hi + secs * (1 + err)
        else:
            phases[phase] = p.seconds
            lo, hi = lo + p.seconds * MODEL_RANGE[0], hi + p.seconds * MODEL_RANGE[1]
    return phases, lo, hi, worst


def _accuracy(spec: TrainSpec, hw: str, *, queue: str, model: Mapping[str, PhaseModel],
              measured: Mapping[str, tuple[float, float]], used: Sequence[Measured], history: Sequence[Measured],
              key: Comparable, worst: float) -> tuple[str, str]:
    """(the stated accuracy, the basis: `history` when earlier jobs measured a phase, else `model`)."""
    calibrated = (f"calibrated model for {hw} with the target in {spec.target.dtype} (typically within "
                  f"{MODEL_RANGE[0]}x-{MODEL_RANGE[1]}x, idle to moderately loaded machine)")
    if hw not in (CALIBRATION_CLASS,) and not hw.startswith("cuda"):
        calibrated += f"; constants measured on {CALIBRATION_CLASS}, scaled for {hw}"
    if measured:
        from_model = [p for p in model if p not in measured and model[p].seconds > 0.5]
        ids = ", ".join(m.job_id for m in used)
        accuracy = (f"from {len(used)} comparable earlier job{'s' if len(used) > 1 else ''} ({ids}; {key.describe()}) "
                    f"for {', '.join(measured)}: ±{round(100 * (worst - 1))}%")
        if from_model:
            accuracy += f"; {', '.join(from_model)}: {calibrated}"
        return accuracy, "history"
    others = len(history) - len(used)
    why = (f" ({others} earlier job{'s' if others > 1 else ''} there differ in target, dtype, engine or "
           "hardware)") if others else ""
    return f"no comparable history on queue {queue}{why}: {calibrated}", "model"


def _first_curve_seconds(spec: TrainSpec, model: Mapping[str, PhaseModel], phases: Mapping[str, float], steps: int,
                         pv: PreviewModel | None) -> float:
    """Seconds from the job's start to its first training metric: its start in the worker, the target's load
    and the preview's first step when the spec has a preview, else every phase before training and one main
    step; each part scaled as the estimate of its phase was (history or model)."""
    prep, start = model["preparing_data"], phases.get("starting", 0.0)
    if pv is not None and "preview" in model:
        own = model["preview"].seconds
        factor = phases["preview"] / own if own > 0 else 1.0
        return start + prep.other_s + pv.first_step_s * factor
    train = model["training"]
    step = train.work / train.rate / steps if steps and train.work > 0 else 0.0
    factor = phases["training"] / train.seconds if train.seconds > 0 else 1.0
    return start + phases["preparing_data"] + phases["regenerating"] + phases["capturing"] + step * factor


def _minutes(seconds: float) -> str:
    """`95` -> `2 min`, `30` -> `30 s`."""
    return f"{round(seconds)} s" if seconds < 90 else f"{round(seconds / 60)} min"
