"""Validation of dataset uploads, in the sandbox, and the report clients see.

- the validator (`validator_command`: `python -m peagle.data.formats`) runs as a sandboxed child
  (`api.uploads.run_sandboxed`: no service secret in its environment, the `Settings.sandbox_*` limits, at
  most `max_concurrent_validations` at once per API process, a waiting upload's request staying open) in
  the upload's folder on the bare file name, so its report names `<filename>: line N`, never a server
  path; a limit it hits is the dataset's `error` ("validation stopped: it exceeded the 4 GiB memory
  limit"); a validator crash is reported as a generic `invalid` dataset (its stderr goes to the server
  log, not to the client);
- the count, rate and byte limits of uploads are `api.uploads`' (one path for datasets and drafts).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, get_args

from api.uploads import UploadState, run_sandboxed
from peagle.spec.schema import DataSource
from service.db.models import Dataset
from service.settings import Settings

__all__ = ["FORMATS", "VALIDATOR", "public_report", "run_validator", "validator_command"]

log = logging.getLogger("peagle.api")

#: The upload formats: the spec's `data.sources[].format` values (one source of truth).
FORMATS: tuple[str, ...] = get_args(DataSource.model_fields["format"].annotation)
VALIDATOR = "peagle.data.formats"


def validator_command(path: Path, fmt: str, settings: Settings) -> list[str]:
    """The dataset validator's command, run in `path`'s folder on its bare name."""
    return [sys.executable, "-m", VALIDATOR, path.name, "--format", fmt,
            "--max-row-bytes", str(settings.max_dataset_row_bytes)]


async def run_validator(path: Path, fmt: str, state: UploadState, *, home: Path) -> dict[str, Any]:
    """The validator's report for `path` (`{ok, error, format, rows_kept, ...}`), run in the sandbox with
    HOME `home`; a breach of a sandbox limit is `{ok: false, error: <the refusal naming it>, limit}`."""
    out = await run_sandboxed(validator_command(path, fmt, state.settings), cwd=path.parent, home=home, state=state)
    if out.breach is not None:
        return {"ok": False, "error": out.message, "limit": out.breach, "validator": VALIDATOR}
    try:
        report = json.loads(out.stdout.decode().strip().splitlines()[-1])
        if not isinstance(report, dict):
            raise ValueError("not an object")
        report.setdefault("validator", VALIDATOR)
        return report
    except (ValueError, IndexError):
        log.error("dataset validator failed on %s (exit %s): %s", path, out.returncode,
                  out.stderr.decode(errors="replace")[-2000:])
        return {"ok": False, "error": f"the validator stopped without a verdict (exit code {out.returncode})",
                "validator": VALIDATOR}


def _scrub(value: Any, replace: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for old, new in replace:
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [_scrub(v, replace) for v in value]
    if isinstance(value, dict):
        return {k: _scrub(v, replace) for k, v in value.items()}
    return value


def public_report(ds: Dataset) -> dict[str, Any]:
    """The dataset's report as clients see it: the file is named by its upload name, never a server path."""
    report = dict(ds.report or {})
    folder = str(Path(ds.path).parent) if ds.path else ""
    pairs = [(p, ds.filename) for p in (ds.path, str(Path(ds.path).resolve()) if ds.path else "") if p]
    if folder:
        pairs.append((folder + "/", ""))
    report = _scrub(report, sorted(set(pairs), key=lambda p: -len(p[0])))
    if "path" in report:
        report["path"] = ds.filename
    return report
