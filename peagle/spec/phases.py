"""The phases of a training run, in order: the one list (the pipeline announces them as `phase` events,
the API serves them at `GET /v1/meta`, the dashboard draws its timeline from that). Torch-free.

`preview` (a short run on the first conversations, `peagle.preview`) comes right after `validating` when the
spec asks for one; its inner phases are log lines (`preview: phase ...`), not phases of the job."""

from __future__ import annotations

__all__ = ["PHASES"]

PHASES = ("validating", "preview", "preparing_data", "regenerating", "building_vocab", "capturing", "training",
          "evaluating", "exporting", "serve_check", "done")
