"""A fake `peagle train` for worker tests: same command line, stream, checkpoints, signals and exit codes.

    python fake_trainer.py train SPEC --out RUN --progress-jsonl - [--resume auto|never]

"Weights" are one float updated deterministically per step, so an interrupted-and-resumed run ends with
exactly the weights of an uninterrupted one. Knobs (environment): FAKE_STEP_SECONDS (sleep per step),
FAKE_KEEP_LAST (only the newest N step folders stay, as the real trainer's retention; 0 keeps all),
FAKE_ENGINE_FAIL_ATTEMPTS (comma-separated attempts, `PEAGLE_ATTEMPT`, whose "target engine" dies after
their first checkpoint: exit 11, `engine_failed`). With `PEAGLE_REGEN_CACHE` it "regenerates" into that
cache once (a file) and reports how many cached answers it found (`regen_cached` of the resumed event).
A data source that is a local JSONL file is validated line by line (exit 4 naming the bad line).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_DATA, EXIT_ENGINE, EXIT_INTERRUPTED = 0, 4, 11, 75
stop = {"n": 0}


PROGRESS = {}


def emit(rec):
    rec.setdefault("time", time.time())
    line = json.dumps(rec) + "\n"
    if "file" in PROGRESS:
        PROGRESS["file"].write(line)
        PROGRESS["file"].flush()
    sys.stdout.write(line)
    sys.stdout.flush()


def on_term(signum, frame):
    stop["n"] += 1
    if stop["n"] > 1:
        os._exit(EXIT_INTERRUPTED)


def save(run, step, w, best):
    ck = run / "checkpoints"
    name = f"step_{step:06d}"
    tmp = ck / f".tmp_{name}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step, "w": w}))
    (tmp / "model.safetensors").write_text(repr(w))
    (tmp / "COMPLETE").write_text("ok")
    final = ck / name
    if final.exists():
        import shutil

        shutil.rmtree(final)
    tmp.rename(final)
    keep = int(os.environ.get("FAKE_KEEP_LAST", "0"))  # retention as the real trainer's keep_last does it
    if keep:
        import shutil

        for old in sorted(ck.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    (ck / "state.json").write_text(json.dumps({"latest": name, "best": name, "best_metric": -w}))
    emit({"type": "event", "kind": "checkpoint", "step": step, "dir": f"checkpoints/{name}",
          "files": [{"path": "model.safetensors", "size": len(repr(w)), "sha256": "0" * 64}],
          "metrics": {"loss": w}, "is_best": best})


def main(argv):
    spec_path, run = Path(argv[1]), Path(argv[argv.index("--out") + 1])
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else "auto"
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    spec = json.loads(spec_path.read_text())
    run.mkdir(parents=True, exist_ok=True)
    PROGRESS["file"] = (run / "progress.jsonl").open("a")
    emit({"type": "event", "kind": "phase", "phase": "validating", "message": "validating"})
    for src in spec["data"]["sources"]:
        p = Path(src["path"])
        if p.is_file():
            for i, line in enumerate(p.read_text().splitlines(), 1):
                try:
                    json.loads(line)
                except ValueError:
                    msg = f"data file {p} line {i}: not valid JSON"
                    emit({"type": "event", "kind": "error", "code": "data_invalid", "message": msg})
                    sys.stderr.write(f"error: {msg}\n")
                    return EXIT_DATA
    (run / "resolved_spec.json").write_text(json.dumps({**spec, "resolved": True}))
    (run / "provenance.json").write_text(json.dumps({"argv": argv, "fake": True}))
    total = spec["optim"].get("max_steps") or 12
    every = spec["checkpoints"]["every_steps"]
    delay = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    step, w = 0, 1.0
    attempt = os.environ.get("PEAGLE_ATTEMPT", "0")
    failing = attempt in os.environ.get("FAKE_ENGINE_FAIL_ATTEMPTS", "").split(",")
    cache = Path(os.environ["PEAGLE_REGEN_CACHE"]) if os.environ.get("PEAGLE_REGEN_CACHE") else None
    cached = len(list(cache.glob("*.jsonl"))) if cache is not None and cache.is_dir() else 0
    if cache is not None and not cached:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "answers.jsonl").write_text('{"answer": "regenerated"}\n')
    cks = sorted((run / "checkpoints").glob("step_*/COMPLETE")) if resume == "auto" else []
    if cks:
        state = json.loads((cks[-1].parent / "state.json").read_text())
        step, w = state["step"], state["w"]
        emit({"type": "event", "kind": "resumed", "message": f"resumed from step {step}", "step": step,
              "regen_cached": cached})
    emit({"type": "event", "kind": "phase", "phase": "training", "message": "training"})
    while step < total:
        time.sleep(delay)
        step += 1
        w = round(w * 0.9 + 0.01 * step, 12)
        emit({"type": "metric", "step": step, "epoch": step / total, "values": {"loss": w, "lr": 0.001}})
        emit({"type": "event", "kind": "progress", "step": step, "total_steps": total, "epoch": step / total})
        if step % every == 0 or step == total:
            save(run, step, w, True)
            if failing:  # what peagle train does when its vLLM engine dies (EngineError -> exit 11)
                msg = (f"vLLM target engine died (pid {os.getpid() + 1}): Error 111 connecting to 127.0.0.1:41234. "
                       "Connection refused; command: vllm serve --host 127.0.0.1 --port 41234")
                emit({"type": "event", "kind": "error", "code": "engine_failed", "message": msg})
                sys.stderr.write(f"error: {msg}\n")
                return EXIT_ENGINE
        if stop["n"]:
            if step % every != 0 and step != total:
                save(run, step, w, False)
            emit({"type": "log", "level": "info", "message": f"interrupted at step {step}"})
            return EXIT_INTERRUPTED
    emit({"type": "event", "kind": "phase", "phase": "exporting", "message": "exporting"})
    (run / "export").mkdir(exist_ok=True)
    (run / "export" / "weights.json").write_text(json.dumps({"w": w, "step": step}))
    emit({"type": "event", "kind": "phase", "phase": "done", "message": "done"})
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
