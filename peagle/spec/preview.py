"""The spec of a job's preview (`preview` in the spec; the run itself is `peagle.preview`). Torch-free: the
pipeline runs it and the dry run estimates it (`service.estimate`).
"""

from __future__ import annotations

from peagle.spec.parse import parse_spec
from peagle.spec.schema import TrainSpec

__all__ = ["preview_off_reason", "preview_spec"]


def preview_off_reason(spec: TrainSpec) -> str | None:
    """Why the preview `spec` asks for does not run (the pipeline logs it, the dry run says it), or None when
    it runs (or none is asked for). A preview runs in the trainer's one process, before the main run, on
    fewer conversations than the data has; so not for a job split over engine workers (`resources.engine`),
    nor under torchrun (`resources.gpus` > 1), nor when the spec caps the data at no more conversations
    than the preview's (a spec made from the demo with a smaller `max_samples` keeps working, without it)."""
    n = spec.preview.conversations
    if n < 1:
        return None
    if spec.resources.engine is not None:
        return "the target runs on engine workers (resources.engine), the preview in the trainer's process"
    if spec.resources.gpus > 1:
        return f"the preview runs in one process, this job under torchrun (resources.gpus {spec.resources.gpus})"
    caps = [s.max_samples for s in spec.data.sources]
    known = sum(c for c in caps if c is not None) if all(c is not None for c in caps) else None
    if spec.data.max_samples is not None:
        known = spec.data.max_samples if known is None else min(known, spec.data.max_samples)
    if known is not None and n >= known:
        return f"the data has at most {known} conversations, no more than preview.conversations ({n})"
    return None


def preview_spec(spec: TrainSpec) -> TrainSpec:
    """The spec of the preview of `spec` (resolved or not): the first `preview.conversations` conversations
    (`data.max_samples`, the cap after all sources, so they are the first ones of the main run too), none held
    out, `preview.steps` optimizer steps (the passes over its rows repeat until they are done), one checkpoint
    at the end (what a resume needs), no evaluation prompts, no serve check, no preview of its own.

    Everything that decides a regenerated answer (target, `data.regenerate`, `data.max_length`, seed) stays,
    so the preview's answers are the cache entries the main run reads.
    """
    n, steps = spec.preview.conversations, spec.preview.steps
    if n < 1:
        raise ValueError("preview.conversations is 0: the spec asks for no preview")
    data = spec.model_dump(mode="json")
    cap = spec.data.max_samples
    data["name"] = f"{spec.name or 'job'} (preview)"[:200]
    data["data"]["max_samples"] = min(n, cap) if cap is not None else n
    data["data"]["eval_samples"] = 0
    ga = spec.optim.grad_accumulation
    # enough passes for `steps` steps even over one micro-batch (total_steps caps the run at max_steps)
    data["optim"].update(max_steps=steps, epochs=min(1000, steps * ga))
    data["checkpoints"].update(every_steps=steps, keep_last=1, select_best_by="tau_sim")
    data["eval"].update(prompt_sets=[], al_every_steps=None, every_steps=None, serve_check=False)
    data["preview"] = {"conversations": 0, "steps": steps}
    return parse_spec(data)
