"""What earlier comparable jobs measured, as rates of each phase's own work.

`Comparable` says which earlier jobs may inform an estimate (the same target and revision, resolved target
dtype, engines and hardware class: a job of another model never does); `Measured` is one of them, read from
the database by `api.history`. `measured_rates` turns its measured seconds into a `PhaseRate` per phase (so a
comparable job of another size scales), and `rates_from_history` combines several into seconds and a spread
(the stated accuracy). Pure functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peagle.spec import TrainSpec
from peagle.spec.funnel import READ
from service.estimate.funnel import data_funnel
from service.estimate.phases import PhaseModel, model_phases

__all__ = ["Comparable", "Measured", "PhaseRate", "measured_rates", "rates_from_history"]


@dataclass(frozen=True)
class Comparable:
    """What makes two jobs' phase rates comparable: the same target (model and revision), resolved target
    dtype, target engine, regeneration engine (`none` without regeneration) and hardware class."""

    model: str
    revision: str | None
    dtype: str
    target_engine: str
    regen_engine: str
    hardware: str

    @classmethod
    def of(cls, resolved: Mapping[str, Any], hardware: str) -> Comparable:
        """From a resolved spec as JSON (a job's `resolved_spec`, or `spec.model_dump(mode="json")`)."""
        target = resolved.get("target") or {}
        regen = (resolved.get("data") or {}).get("regenerate") or {}
        res = resolved.get("resources") or {}
        split = res.get("engine")  # engine workers beside the trainer (issue 37): another training rate
        engine = str(res.get("target_engine")) + (
            f" split over {split.get('replicas')} engine workers of {split.get('gpus')} GPUs"
            if isinstance(split, dict) else "")
        return cls(model=str(target.get("model")), revision=target.get("revision"), dtype=str(target.get("dtype")),
                   target_engine=engine,
                   regen_engine=str(regen.get("engine")) if regen.get("enabled") is True else "none",
                   hardware=hardware)

    def describe(self) -> str:
        """One line naming what the compared jobs share (the estimate's `accuracy` quotes it)."""
        rev = f"@{self.revision}" if self.revision else ""
        return (f"target {self.model}{rev} in {self.dtype}, target engine {self.target_engine}, regeneration "
                f"{self.regen_engine}, hardware {self.hardware}")


@dataclass(frozen=True)
class Measured:
    """One earlier succeeded job: its resolved spec, what makes it comparable, the measured seconds of each
    `calibration.PHASE_GROUPS` phase, the optimizer steps it ran, its counted data funnel (None: not recorded, the model's
    is used) and the tokens its regeneration generated (None: not recorded; 0: every answer was cached)."""

    job_id: str
    spec: TrainSpec
    key: Comparable
    phase_seconds: Mapping[str, float]
    steps: int
    funnel: Mapping[str, Any] | None = None
    regen_tokens: int | None = None


@dataclass(frozen=True)
class PhaseRate:
    """What one earlier job measured of one phase: its rate of the phase's own work (None: it did none) and
    the factor on the model's `other_s` seconds (at most 1 when it did work: a faster machine)."""

    rate: float | None
    other_factor: float


def measured_rates(m: Measured) -> dict[str, PhaseRate]:
    """Per phase that `m` ran (and the model gives more than half a second), its measured rate.

    The measured seconds are split as the model splits them when the job was faster than modelled (both
    parts scaled), else the model's `other_s` is taken as it is and the rest is the phase's own work; so an
    estimate of the same spec from these rates gives back the measured seconds."""
    fun: Mapping[str, Any] = m.funnel if m.funnel and m.funnel.get(READ) else data_funnel(m.spec, {}, [])
    model = model_phases(m.spec, read=int(fun[READ]), steps=m.steps, packed_rows=int(fun.get("packed_rows") or 0),
                         hardware=m.key.hardware)
    out: dict[str, PhaseRate] = {}
    for phase, secs in m.phase_seconds.items():
        p = model.get(phase)
        if p is None or p.seconds <= 0.5 or secs <= 0:
            continue
        work = p.work
        if phase == "regenerating":  # the tokens it generated; cached answers are no work (and no rate)
            if not m.regen_tokens:
                continue
            work = float(m.regen_tokens)
        if work > 0:
            factor = min(1.0, secs / p.seconds)
            out[phase] = PhaseRate(rate=work / (secs - p.other_s * factor), other_factor=factor)
        elif p.other_s > 0:
            out[phase] = PhaseRate(rate=None, other_factor=secs / p.other_s)
    return out


def rates_from_history(model: Mapping[str, PhaseModel], rates: Mapping[str, list[PhaseRate]]
                       ) -> dict[str, tuple[float, float]]:
    """Per phase with measurements: (seconds, spread) where seconds uses the median rate and other-factor and
    spread is the largest factor by which one job's own rates would differ from that (1.0: one job)."""
    out: dict[str, tuple[float, float]] = {}
    for phase, rs in rates.items():
        p = model.get(phase)
        if p is None or not rs or p.seconds <= 0:
            continue

        def secs(rate: float | None, factor: float, p: PhaseModel = p) -> float:
            return p.other_s * factor + (p.work / rate if p.work > 0 and rate else 0.0)

        with_rate = [r.rate for r in rs if r.rate]
        if p.work > 0 and not with_rate:
            continue  # earlier jobs did none of this phase's work: nothing to scale it by
        mid = secs(statistics.median(with_rate) if with_rate else None, statistics.median(r.other_factor for r in rs))
        each = [secs(r.rate if r.rate else None, r.other_factor) for r in rs if r.rate or p.work <= 0]
        spread = max((max(e / mid, mid / e) for e in each if e > 0 and mid > 0), default=1.0)
        out[phase] = (mid, spread)
    return out
