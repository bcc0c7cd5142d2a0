"""The `peagle train | export | eval | validate` commands (registered on the app of `peagle.cli`).

User mistakes (bad spec, missing file, invalid export, unknown prompt set ...) end with ONE line on
stderr (`error: <reason>`) and the exit code of `peagle.errors.EXIT_CODES`; never a traceback
(`PEAGLE_DEBUG=1` adds it for bugs). `train` follows the trainer process contract: JSON lines on
stdout with `--progress-jsonl -`, RUN/progress.jsonl always, a progress bar on stderr when it is a TTY,
exit 75 after a SIGTERM/SIGINT (checkpoint saved; resume with `--resume auto`).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import typer

from peagle.errors import EXIT_CODES, PeagleError, TrainingInterrupted
from peagle.run_folder import CHECKPOINTS, EXPORT, STATE_FILE
from peagle.train.signals import stop_reason

__all__ = ["register"]

F = TypeVar("F", bound=Callable[..., Any])


class Resume(StrEnum):
    auto = "auto"
    never = "never"


class Layout(StrEnum):
    speculators = "speculators"
    eagle3 = "eagle3"


class Engine(StrEnum):
    reference = "reference"
    vllm = "vllm"
    both = "both"


def _fail(message: str, code: int) -> typer.Exit:
    first = " ".join(message.strip().split("\n")) if message.strip() else "unknown error"
    sys.stderr.write(f"error: {first}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def _exit_code_for(exc: BaseException) -> tuple[str, int]:
    from peagle.spec import SpecInvalidError

    if isinstance(exc, SpecInvalidError):
        return "spec_invalid", EXIT_CODES["spec_invalid"]
    if isinstance(exc, PeagleError):
        code = getattr(exc, "code", "error")
        return code, EXIT_CODES.get(code, EXIT_CODES["error"])
    if isinstance(exc, MemoryError):
        return "host_oom", EXIT_CODES["host_oom"]
    oom = getattr(__import__("torch"), "OutOfMemoryError", None) if "torch" in sys.modules else None
    if oom is not None and isinstance(exc, oom):
        return "cuda_oom", EXIT_CODES["cuda_oom"]
    if isinstance(exc, FileNotFoundError | NotADirectoryError | PermissionError):
        return "error", EXIT_CODES["usage"]
    return "error", EXIT_CODES["error"]


def _user_errors(fn: F) -> F:
    """Turn library errors into one stderr line + exit code; bugs keep their traceback under PEAGLE_DEBUG."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except TrainingInterrupted as exc:  # a pause or Ctrl-C: said as what it is, not as an error
            sys.stderr.write(f"{exc}\n")
            sys.stderr.flush()
            raise typer.Exit(EXIT_CODES["interrupted"]) from None
        except Exception as exc:  # noqa: BLE001 - the CLI boundary: every failure becomes one line + exit code
            code, rc = _exit_code_for(exc)
            if os.environ.get("PEAGLE_DEBUG"):
                traceback.print_exc()
            msg = str(exc) if code != "error" or rc == EXIT_CODES["usage"] else f"{type(exc).__name__}: {exc}"
            raise _fail(msg, rc) from None

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------


class _EarlyStop(BaseException):
    """Raised by the early signal handler; a BaseException so no `except Exception` on the way swallows it."""


#: Seconds before a dropped `_EarlyStop`'s signal is sent again (`_install_early_interrupt`).
REDELIVER_S = 0.05


def _install_early_interrupt() -> Callable[[], None]:
    """Outside the training loop a first SIGTERM/SIGINT exits 75 (data is cached; resume redoes the rest).

    The handler raises `_EarlyStop` wherever the main thread is. Where that is inside a finalizer (a
    `__del__`, a weakref callback of the garbage collector), Python drops the exception and reports it to
    `sys.unraisablehook`: the stop was lost and the run went on (seen: raised in `regex`'s `__del__`, the
    run exited 0). So a dropped `_EarlyStop` sends its signal again, as a first one; a signal the sender
    sends twice still exits at once.

    Returns a function that restores the previous handlers and hook.
    """
    state = {"count": 0}
    previous_hook = sys.unraisablehook

    def handler(signum: int, frame: Any) -> None:
        state["count"] += 1
        if state["count"] > 1:
            os._exit(EXIT_CODES["interrupted"])
        raise _EarlyStop(signum)

    def again(signum: int) -> None:
        time.sleep(REDELIVER_S)  # from a thread, later: a signal sent from the hook lands in the hook
        state["count"] = 0  # ours again, not the sender's second signal
        os.kill(os.getpid(), signum)

    def dropped(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, _EarlyStop):
            threading.Thread(target=again, args=(unraisable.exc_value.args[0],), daemon=True).start()
            return
        previous_hook(unraisable)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    sys.unraisablehook = dropped

    def restore() -> None:
        sys.unraisablehook = previous_hook
        for signum, old in previous.items():
            signal.signal(signum, old)

    return restore


def train_cmd(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML or JSON), or a preset name: demo, tiny, ..."),
    out: Path = typer.Option(..., "--out", help="Run directory (RUN)."),
    progress_jsonl: str | None = typer.Option(
        None, "--progress-jsonl", help="'-' = JSON lines on stdout, or a file."
    ),
    resume: Resume = typer.Option(
        Resume.auto, "--resume", help="auto: continue from the newest complete checkpoint."
    ),
    init_from: str | None = typer.Option(
        None, "--init-from",
        help="Warm start (sets draft.init_from): an export folder, a checkpoint folder or a run directory "
        "(its best checkpoint); the draft starts from its weights, with a fresh optimizer.",
    ),
) -> None:
    """Train a P-EAGLE draft: data, vocab, capture, train, evaluate, export (RUN/export)."""
    from peagle.progress import ConsoleSink, JsonlSink, MultiSink, ProgressSink

    # Progress on stderr for a person: a bar on a terminal, plain lines when piped; not when the JSON lines
    # go to a piped stdout (the worker: it files stderr lines in the job log, which has the records already).
    console = ConsoleSink(sys.stderr, bar=sys.stderr.isatty()) \
        if sys.stderr.isatty() or progress_jsonl != "-" else None
    sinks: list[ProgressSink] = []
    try:
        spec = _load_spec(spec_file)
        if init_from is not None:
            from peagle.spec import parse_spec

            spec = parse_spec({**spec.model_dump(mode="json", exclude_unset=True),
                               "draft": {**spec.draft.model_dump(mode="json", exclude_unset=True),
                                         "init_from": init_from}})
    except Exception as exc:
        _report_error(progress_jsonl, exc)
        raise
    if console is not None:  # after the spec: a bad spec still ends with its one `error:` line
        console.log("info", f"peagle train {spec_file} -> {out}: loading")
    out.mkdir(parents=True, exist_ok=True)
    file_sink = JsonlSink(out / "progress.jsonl")
    sinks.append(file_sink)
    if progress_jsonl == "-":
        sinks.append(JsonlSink(sys.stdout))
    elif progress_jsonl:
        sinks.append(JsonlSink(progress_jsonl))
    if console is not None:
        sinks.append(console)
    sink = MultiSink(*sinks)
    restore_signals = _install_early_interrupt()
    try:
        from peagle.pipeline import run_pipeline

        result = run_pipeline(spec, out, sink=sink, resume=resume.value)
    except TrainingInterrupted:
        raise
    except _EarlyStop as stop:
        why = stop_reason(stop.args[0])
        sink.log("info", f"stopping: {why} (before training ended; what is done is kept)")
        raise TrainingInterrupted(f"stopped: {why}; resume with --resume auto") from None
    except BaseException as exc:
        code, _ = _exit_code_for(exc)
        sink.event("error", code=code, message=str(exc).split("\n")[0] or type(exc).__name__)
        raise
    finally:
        restore_signals()
        file_sink.close()
        if console is not None:
            console.close()
    if progress_jsonl != "-":
        typer.echo(json.dumps({"export": str(result.export_dir), "checkpoint": result.best_checkpoint,
                               "acceptance_length": result.eval.get("acceptance_length"),
                               "per_position": result.eval.get("per_position")}))  # fmt: skip


def _report_error(progress_jsonl: str | None, exc: BaseException) -> None:
    if progress_jsonl == "-":
        from peagle.progress import JsonlSink

        code, _ = _exit_code_for(exc)
        JsonlSink(sys.stdout).event("error", code=code, message=str(exc).split("\n")[0])


def _load_spec(spec_file: Path) -> Any:
    from peagle.spec import SpecInvalidError, SpecProblem, load_spec_file, preset, preset_names

    if not spec_file.exists() and str(spec_file) in preset_names():
        return preset(str(spec_file))
    if not spec_file.is_file():
        raise SpecInvalidError(
            [SpecProblem(loc=(), message=f"{spec_file}: no such spec file (or preset name)")]
        )
    return load_spec_file(spec_file)


# --------------------------------------------------------------------------------------------------
# export / validate / eval
# --------------------------------------------------------------------------------------------------


def _export_dir_of(path: Path) -> Path:
    """An export dir from a RUN dir (RUN/export), a checkpoint dir, or an export dir itself."""
    from peagle.errors import CheckpointError

    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if (path / "config.json").is_file():
        return path
    if (path / EXPORT / "config.json").is_file():
        return path / EXPORT
    state = path / CHECKPOINTS / STATE_FILE
    if state.is_file():
        best = json.loads(state.read_text()).get("best")
        if best and (path / CHECKPOINTS / best / "config.json").is_file():
            return path / CHECKPOINTS / best
    raise CheckpointError(f"{path}: not an export, checkpoint or run directory (no config.json)")


def export_cmd(
    ckpt: Path = typer.Argument(..., help="Checkpoint dir, run dir (its best checkpoint) or export dir."),
    out: Path = typer.Option(..., "--out", help="Destination directory (replaced)."),
    layout: Layout = typer.Option(
        Layout.speculators, "--layout", help="speculators (vllm serve DIR) or eagle3."
    ),
) -> None:
    """Write a vLLM-ready export of a checkpoint (validated)."""
    from peagle.export.writer import (
        export_draft,
        load_exported_draft,
        num_speculative_tokens_of,
        read_export_config,
        verifier_of,
    )

    src = _export_dir_of(ckpt)
    cfg = read_export_config(src)
    draft = load_exported_draft(src)
    name = verifier_of(cfg) or ""
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    if layout == Layout.speculators and not name:
        raise _fail(f"{src}: no verifier recorded; export it from a speculators-format checkpoint", 2)
    export_draft(
        draft,
        out,
        num_speculative_tokens=num_speculative_tokens_of(cfg),
        verifier_name_or_path=name,
        verifier_architectures=list(verifier.get("architectures") or ["LlamaForCausalLM"]),
        layout=layout.value,
    )
    typer.echo(f"exported {src} -> {out} ({layout.value} layout, validated)")


def validate_cmd(
    directory: Path = typer.Argument(..., help="Export dir (or a run dir: RUN/export)."),
    as_json: bool = typer.Option(False, "--json", help="Print {ok, violations, not_here, warnings} as JSON."),
    portable: bool = typer.Option(False, "--portable", help="Only the export's own rules and files: leave out "
                                  "whether this machine's vLLM can run it, and never read a host path the "
                                  "export names (for an export served elsewhere, or uploaded)."),
) -> None:
    """Check a directory against every rule vLLM enforces for a P-EAGLE draft, and whether this machine's
    vLLM can run it (`peagle.engine.machine`: vLLM's CPU attention takes only some head sizes).

    Any input gets an answer (with `--json`, always one JSON line), in bounded memory: docs/export.md 5.1.

    Errors (vLLM refuses the draft or serves it wrongly, or cannot run it here) exit 8; warnings
    (conventions vLLM does not enforce, e.g. fp32 weights) are printed to stderr and exit 0.
    """
    from peagle.engine.machine import vllm_here_problems
    from peagle.errors import ExportInvalidError
    from peagle.export.rules import validate_export_report

    target = directory / EXPORT if (directory / EXPORT / "config.json").is_file() else directory
    report = validate_export_report(target, portable=portable)
    bad = report.errors
    not_here = [] if bad or portable else vllm_here_problems(target)  # valid, but this machine's vLLM cannot run it
    if not bad and not not_here:  # with errors stderr keeps its one `error:` line (warnings are in --json)
        for w in report.warnings:
            typer.echo(f"warning: {w}", err=True)
    if as_json:
        typer.echo(json.dumps({"dir": str(target), "ok": not bad and not not_here, "violations": bad,
                               "not_here": not_here, "warnings": report.warnings}))
        if bad or not_here:
            raise typer.Exit(EXIT_CODES["export_invalid"])
        return
    if bad:
        raise _fail(str(ExportInvalidError(bad)), EXIT_CODES["export_invalid"])
    if not_here:
        raise _fail(f"{target} cannot run in this machine's vLLM: " + "; ".join(not_here),
                    EXIT_CODES["export_invalid"])
    note = f" ({len(report.warnings)} warnings)" if report.warnings else ""
    typer.echo(f"ok: {target} is a valid vLLM P-EAGLE export{note}")


def eval_cmd(
    directory: Path = typer.Argument(..., help="Export dir (or run / checkpoint dir)."),
    prompts: list[str] = typer.Option(
        ["humaneval"], "--prompts",
        help="humaneval | sharegpt-heldout | heldout (RUN/export's own held-out conversations) | a JSONL path; "
        "repeat for several sets (AL reported per set).",
    ),
    num_prompts: int = typer.Option(40, "--num-prompts", min=1),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    num_speculative_tokens: int | None = typer.Option(None, "--num-speculative-tokens", min=1),
    engine: Engine = typer.Option(Engine.reference, "--engine", help="reference (PyTorch), vllm, or both."),
    target: str | None = typer.Option(
        None, "--target", help="Target folder (default: the export's verifier)."
    ),
    dtype: str = typer.Option(
        "auto", "--dtype",
        help="Reference decoder dtypes: auto (as the job's own eval: target in the export's bf16, draft "
        "fp32) | float32 | bfloat16.",
    ),
    speedup: bool = typer.Option(
        False, "--speedup",
        help="Also time vLLM serving: the verifier alone vs with the draft, interleaved, at batch 1 and at a "
        "batch of all --num-prompts prompts of the first set (needs --engine vllm or both).",
    ),
    batch_sizes: list[int] = typer.Option([], "--batch-size", min=1, help="Another batch size to time (repeat)."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds; the speedup is their median."),
    sweep: bool = typer.Option(
        False, "--sweep/--no-sweep",
        help="Time every K from 1 to the export's K (one engine start each) and recommend the best per batch size.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Measure acceptance length (AL, vLLM's pooled definition) per prompt set and, with --speedup, the
    serving speedup of an export."""
    from peagle.cli.evaluate import run_eval
    from peagle.eval.speedup import plan_speedup
    from peagle.export.writer import num_speculative_tokens_of, read_export_config
    from peagle.progress import ConsoleSink

    if speedup and engine == Engine.reference:
        raise _fail("--speedup times vLLM serving: use --engine vllm (or both)", EXIT_CODES["spec_invalid"])
    src = _export_dir_of(directory)
    if engine != Engine.reference and target is None:  # refused now, not by vLLM's trace minutes later
        from peagle.engine.machine import vllm_here_problems

        not_here = vllm_here_problems(src)
        if not_here:
            raise _fail(f"--engine {engine.value}: {src} cannot run in this machine's vLLM: " + "; ".join(not_here),
                        EXIT_CODES["resource_unavailable"])
    plan = None
    if speedup:
        k = num_speculative_tokens or num_speculative_tokens_of(read_export_config(src))
        plan = plan_speedup(k, num_prompts, sweep=sweep, batch_sizes=batch_sizes, rounds=rounds)
    # progress on stderr (the report goes to stdout), once the arguments were checked (a mistake: one line)
    console = ConsoleSink(sys.stderr, bar=sys.stderr.isatty())
    console.log("info", f"peagle eval {directory}: loading")
    report = run_eval(
        src, prompts=prompts, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens, engine=engine.value, target=target, dtype=dtype,
        speedup=plan, sink=console,
    )  # fmt: skip
    console.close()
    parity = report.get("parity")
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_eval(report, src)
    if parity and parity.get("fails"):  # the report is printed; the exit code says the export mis-serves
        raise _fail(parity["message"], EXIT_CODES["served_parity_failed"])


def _print_eval(report: dict[str, Any], src: Path) -> None:
    from peagle.eval.speedup import speculative_config, speedup_text
    from peagle.export.rules import verifier_of
    from peagle.export.writer import read_export_config

    typer.echo(f"acceptance_length {report.get('acceptance_length')}")
    typer.echo(f"per_position {report.get('per_position')}")
    for key in ("per_request_spread", "tokens_generated", "num_drafts", "engine"):
        typer.echo(f"{key} {report.get(key)}")
    sets = report.get("prompt_sets") or {}
    if len(sets) > 1:
        for name, rep in sets.items():
            typer.echo(f"prompt set {name}: acceptance_length {rep.get('acceptance_length')}")
    serving = report.get("serving")
    if serving:
        hw = serving.get("hardware") or {}
        typer.echo(f"serving speedup in vLLM {serving.get('vllm_version')} on {hw.get('device')} "
                   f"{hw.get('gpu') or hw.get('cpu')} ({hw.get('cpu_count')} CPUs), {serving.get('rounds')} rounds, "
                   f"AL {serving.get('acceptance_length')}:")  # fmt: skip
        for row in serving.get("table") or []:
            cpu = row.get("speedup_cpu_time")
            typer.echo(f"  K={row['num_speculative_tokens']} batch {row['batch_size']}: "
                       f"{row['base_tokens_per_s']:.1f} -> {row['spec_tokens_per_s']:.1f} tokens/s, "
                       f"{speedup_text(row['speedup'])}" + (f" (by CPU time {cpu:.2f}x)" if cpu else ""))  # fmt: skip
        for rec in serving.get("recommended") or []:
            k_rec = rec["num_speculative_tokens"]
            typer.echo(f"  recommended at batch {rec['batch_size']}: "
                       + (f"K={k_rec}" if k_rec else "no draft (slower at every K measured)"))
        # the K schedule by batch size (peagle.eval.speedup.k_schedule) in the command that serves it
        recs = serving.get("recommended") or []
        cfg = speculative_config(str(src), recs, int(serving.get("num_speculative_tokens") or 1)) if recs else None
        if cfg is not None:
            verifier = verifier_of(read_export_config(src)) or "VERIFIER"
            typer.echo(f"  serve with: vllm serve {shlex.quote(verifier)} --speculative-config "
                       f"{shlex.quote(json.dumps(cfg))}")
    if report.get("parity"):
        typer.echo(report["parity"]["message"])


def register(app: typer.Typer) -> None:
    """Add train, export, eval and validate to the `peagle` app."""
    app.command("train")(_user_errors(train_cmd))
    app.command("export")(_user_errors(export_cmd))
    app.command("eval")(_user_errors(eval_cmd))
    app.command("validate")(_user_errors(validate_cmd))
