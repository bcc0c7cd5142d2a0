"""The phases of a training run, in order: the one list (the pipeline announces them as `phase` events,
the API serves them at `GET /v1/meta`, the dashboard draws its timeline from that). Torch-free."""

from __future__ import annotations

__all__ = ["PHASES"]

PHASES = ("validating", "preparing_data", "regenerating", "building_vocab", "capturing", "training", "evaluating",
          "exporting", "serve_check", "done")
