"""The probe engine: run `peagle/engine/probe.py` in vLLM's venv on an export, under the guard.

    raw = run_probe(export_dir, al={"chat": prompts}, max_new_tokens=128)    # the probe's raw JSON

vLLM lives in its own venv (`make vllm-env` builds `.vllm-venv`; it pins a different transformers), so
this module never imports it: it writes a plan (the tokenised prompts) into a temporary folder, starts the
probe with that venv's Python (`PEAGLE_VLLM_PYTHON` points at another interpreter, e.g. a GPU vLLM; the
probe uses CUDA when that interpreter's torch sees a GPU) and reads back the JSON it writes. The numbers
are derived on the project side (`peagle.eval.serve_check`).

The probe runs under `peagle.engine.guard` like `vllm serve`: in a process group of its own, with the
environment of `peagle.engine.environment.vllm_env` (no secret of the worker), taken down (SIGTERM, then
SIGKILL) when the probe is done, when it times out, when the caller raises, and when the process that
started it dies, even by SIGKILL (the guard polls its parent). The guard then removes the probe's
temporary folder (plan, result, log, the export's view), so nothing is left however the run ends
(tests/engine/test_probe_lifecycle.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from peagle.engine import procs
from peagle.engine.environment import vllm_env
from peagle.engine.guard import guarded
from peagle.engine.locate import vllm_python
from peagle.engine.server import PLUGINS_DIR
from peagle.errors import ResourceError

__all__ = ["PROBE_GRACE_S", "loadable_export", "probe_script", "run_probe"]

#: Seconds between the SIGTERM and the SIGKILL of a probe's process group (it holds no state worth saving).
PROBE_GRACE_S = 10.0


def probe_script() -> Path:
    """Path of the script run inside the vLLM venv."""
    return Path(__file__).resolve().with_name("probe.py")


def _verifier_of(export_dir: Path) -> str | None:
    from peagle.errors import ExportInvalidError
    from peagle.export.rules import read_export_config, verifier_of

    try:
        return verifier_of(read_export_config(export_dir))
    except ExportInvalidError:
        return None


@contextlib.contextmanager
def loadable_export(export_dir: str | Path, verifier: str | Path | None, *, workdir: Path | None = None
                    ) -> Iterator[Path]:
    """The export as vLLM on this machine must see it: its config naming `verifier` (a local folder).

    Exports name a portable verifier (a hub id, `builtin:tiny-llama`); loading one here needs the local
    folder. When the names differ, yields a folder with a rewritten `config.json` and links to the other
    files (the export itself is never touched): under `workdir` when given (the caller removes it), else
    a temporary folder removed on exit. Else yields the export.
    """
    src = Path(export_dir).resolve()
    name = str(verifier.resolve()) if isinstance(verifier, Path) else verifier
    if verifier is None or _verifier_of(src) in (None, name):
        yield src
        return
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["speculators_config"]["verifier"]["name_or_path"] = name
    with contextlib.ExitStack() as stack:
        root = workdir if workdir is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="peagle-export-")))  # fmt: skip
        view = root / src.name
        view.mkdir()
        for entry in src.iterdir():
            if entry.name != "config.json":
                (view / entry.name).symlink_to(entry)
        (view / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        yield view


def _plan(model_dir: Path, verifier: str, sets: Mapping[str, list[list[int]]], timed: dict[str, Any] | None, *,
          max_new_tokens: int, num_speculative_tokens: int | None, max_model_len: int | None, calibrate: bool
          ) -> dict[str, Any]:
    longest = max((len(p) for ps in [*sets.values(), (timed or {}).get("prompts", [])] for p in ps), default=0)
    return {
        "model": str(model_dir),
        "verifier": verifier,
        "num_speculative_tokens": num_speculative_tokens,
        "max_model_len": max_model_len or max(1024, longest + max_new_tokens + 40),
        "al": {"max_new_tokens": max_new_tokens, "sets": [{"name": n, "prompts": p} for n, p in sets.items()]}
        if sets else None,
        "speedup": timed,
        "calibrate": calibrate,
    }


def run_probe(
    export_dir: str | Path,
    *,
    al: Mapping[str, Sequence[Sequence[int]]] | None = None,
    max_new_tokens: int = 128,
    speedup: Any = None,
    speedup_prompts: Sequence[Sequence[int]] | None = None,
    num_speculative_tokens: int | None = None,
    max_model_len: int | None = None,
    timeout_s: float = 3600.0,
    python: str | Path | None = None,
    log_path: str | Path | None = None,
    verifier: str | Path | None = None,
) -> dict[str, Any]:
    """Run the probe on an export and return its raw JSON (the probe's module docstring says what is in it).

    Args:
        export_dir: a speculators-format export.
        al: prompt set name -> token ids per prompt (chat-templated, identical to the reference decoder's);
            each set is generated in one batch and reported per request.
        max_new_tokens: per prompt (greedy), for `al` and the speedup passes.
        speedup: what to time (a `peagle.eval.speedup.SpeedupPlan`), on `speedup_prompts`.
        num_speculative_tokens: K of the draft engine; None = `speculative_tokens` of the config.
        max_model_len: vLLM's context limit; None = the longest prompt + new tokens + K, at least 1024.
        timeout_s: wall-clock limit for the probe.
        python: the vLLM interpreter; None = `vllm_python()`.
        log_path: where vLLM's own output goes (default: in the probe's temporary folder, named in errors).
        verifier: the target vLLM loads (a local folder); None = the export's verifier mapped to this
            machine by `peagle.builtin.local_verifier` (a builtin's hub id -> its offline folder).

    Raises:
        ResourceError: no vLLM venv, or the probe crashed / timed out (message names the log's last lines).
    """
    py = Path(python) if python is not None else vllm_python()
    if py is None:
        raise ResourceError(
            "vLLM is not installed: run `make vllm-env` (builds .vllm-venv) or set PEAGLE_VLLM_PYTHON"
        )
    named = _verifier_of(Path(export_dir))
    if verifier is None and named:
        from peagle.builtin import local_verifier

        verifier = local_verifier(named)
    sets = {name: [list(map(int, p)) for p in prompts] for name, prompts in (al or {}).items()}
    timed = speedup.for_probe(speedup_prompts or [], max_new_tokens) if speedup is not None else None
    tmp = Path(tempfile.mkdtemp(prefix="peagle-vllm-"))  # the guard removes it too, if we cannot
    try:
        with loadable_export(export_dir, verifier, workdir=tmp) as model_dir:
            plan = _plan(model_dir, str(verifier if verifier is not None else named), sets, timed,
                         max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len, calibrate=bool(speedup is not None and speedup.calibrate))
            plan_file, out_file = tmp / "plan.json", tmp / "result.json"
            plan_file.write_text(json.dumps(plan), encoding="utf-8")
            log = Path(log_path) if log_path is not None else tmp / "vllm.log"
            cmd = [str(py), str(probe_script()), "--plan", str(plan_file), "--out", str(out_file)]
            # our vLLM plug-ins on its path: `peagle_tree` ties the probe's engine core to the probe, so a
            # killed probe (or guard) leaves nothing of its engine behind (docs/engine.md 3)
            # its temporary folder is `tmp`: what vLLM and torch leave there goes with it, even when killed
            env = vllm_env(python=py, devices=None, offline=True, pythonpath=[PLUGINS_DIR], tmpdir=tmp)
            with log.open("w") as fh:
                proc = guarded(cmd, env=env, grace_s=PROBE_GRACE_S, cleanup=[tmp], stdout=fh,
                               stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise ResourceError(f"vLLM probe timed out after {timeout_s:.0f} s") from None
            finally:  # done, timed out, or the caller raised (KeyboardInterrupt too): the group goes
                procs.stop_group(proc, grace_s=PROBE_GRACE_S + 10)
            if not out_file.exists():
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise ResourceError(f"vLLM probe failed (exit {rc}): " + " | ".join(tail))
            result: dict[str, Any] = json.loads(out_file.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
