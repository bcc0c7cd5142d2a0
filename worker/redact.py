"""What the worker stores for clients never names a server path (issue 19).

A job's events, logs, error message, resolved spec and provenance are returned by the API to the job's
owner. The trainer's output names the files it reads and writes: the uploaded dataset's file, the run
directory, the artifact/dataset roots, the Python install and the home folder (caches). `Redactor`
rewrites those to stable placeholders before anything is written to the database:

    <dataset file>        -> dataset:<id>        (what the spec said)
    run directory         -> <run>
    artifact/dataset root -> <artifacts> / <datasets>
    service home          -> <home>
    sys.prefix / app dir  -> <python> / <app>
    the user's home       -> ~
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peagle.spec import dataset_ref
from service.settings import Settings

__all__ = ["Redactor"]

_APP = Path(__file__).resolve().parents[1]


class Redactor:
    """Replaces known server paths in strings (and in nested lists/dicts of them)."""

    def __init__(self, settings: Settings, run_dir: Path, dataset_files: Mapping[str, str] | None = None) -> None:
        pairs: dict[str, str] = {}
        for path, ds_id in (dataset_files or {}).items():
            pairs[str(path)] = dataset_ref(ds_id)
            pairs[str(Path(path).parent)] = "<datasets>"
        pairs[str(run_dir)] = "<run>"
        pairs[str(settings.resolved_artifact_root())] = "<artifacts>"
        pairs[str(settings.resolved_dataset_root())] = "<datasets>"
        pairs[str(settings.home.resolve())] = "<home>"
        pairs[sys.prefix] = "<python>"
        pairs[sys.base_prefix] = "<python>"
        pairs[str(_APP)] = "<app>"
        home = str(Path.home())
        if home not in ("/", ""):
            pairs[home] = "~"
        self.pairs = sorted(((k, v) for k, v in pairs.items() if len(k) > 1), key=lambda kv: -len(kv[0]))

    def text(self, s: str) -> str:
        """`s` with every known server path replaced."""
        for old, new in self.pairs:
            if old in s:
                s = s.replace(old, new)
        return s

    def value(self, v: Any) -> Any:
        """A JSON-like value with every string redacted (keys included)."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list | tuple):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(x) for k, x in v.items()}
        return v
