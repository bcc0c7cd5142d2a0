"""Engine scaling of a split job's capture (issue 37): tokens/s of two engine executors each pinned to one
core against one executor on one core, the same plan and chunks (goal >= 1.8x).

    python -m bench.bench_engine_scaling [--conversations 96] [--chunk 2] [--out DIR]
    python -m bench.bench_engine_scaling --first-step SPLIT_RUN ONE_WORKER_RUN   # time to the first step

Each executor is a process started under `taskset -c <core>` (its `vllm serve` inherits the core, and
`VLLM_CPU_OMP_THREADS_BIND` binds vLLM's threads to it). It starts a SmolLM2 capture engine, says it is
ready, waits for the start signal, then takes chunks of the plan one by one (a claim file per chunk:
first come, first served, as engine workers take chunk tasks from the queue) and runs them with
`peagle.target.remote.run_capture_chunk`, the engine workers' own code. Engine start-up and shutdown are not counted (the wall time is the last executor's own, start signal to last chunk).
`--first-step` reads two finished runs' `progress.jsonl` and prints the seconds from the trainer's first
line to its first step in each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

AUX = [2, 15, 27]


def _rows(n: int) -> Any:
    from transformers import AutoTokenizer

    from peagle.builtin import sharegpt_path, smollm2_dir
    from peagle.data.formats import IngestReport, iter_rows
    from peagle.data.packing import pack_documents
    from peagle.data.template import tokenize_many

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    convs = [r.messages for r in iter_rows(sharegpt_path(), "sharegpt", IngestReport(), max_samples=n) if r.messages]
    enc = tokenize_many(tok, convs, max_length=384, think="keep", workers=1)
    return pack_documents([(e.input_ids, e.loss_mask) for e in enc if sum(e.loss_mask) > 0], 512, seed=0)


def prepare(d: Path, conversations: int, chunk: int) -> int:
    """Write the plan (every chunk released); returns the number of chunks."""
    from peagle.split.protocol import capture_plan, write_release
    from peagle.target.remote import write_plan

    rows = _rows(conversations)
    plan = capture_plan(num_rows=len(rows), pack_length=int(rows.input_ids.shape[1]), hidden_size=576,
                        micro_batch_size=1, seed=0, total_micro_batches=len(rows), aux_layer_ids=AUX,
                        chunk_micro_batches=chunk)
    write_plan(d, plan, rows)
    write_release(d, generation=1, start=0, consumed=-1, released=len(plan["chunks"]))
    return len(plan["chunks"])


def executor(d: Path, k: int, core: int) -> None:
    """One engine executor (run in its own pinned process)."""
    import torch

    from peagle.builtin import smollm2_dir
    from peagle.engine.server import CaptureOptions, EngineConfig, VllmServer
    from peagle.split.protocol import read_plan
    from peagle.target.parts import load_target_parts
    from peagle.target.remote import run_capture_chunk
    from peagle.target.vllm_capture import VllmCapture

    path = smollm2_dir()
    plan = read_plan(d)
    assert plan is not None
    cfg = EngineConfig(model=str(path), dtype="bfloat16", max_model_len=640,
                       capture=CaptureOptions(layer_ids=(*AUX, 30), storage_dir=d / f"hs{k}"),
                       env=(("VLLM_CPU_OMP_THREADS_BIND", str(core)),))
    parts = load_target_parts(path, dtype=torch.bfloat16)
    with VllmServer(cfg, log_path=d / f"engine{k}.log", name=f"engine {k}") as server:
        cap = VllmCapture(server, parts, AUX)
        (d / f"ready{k}").write_text("ok")
        while not (d / "go").exists():
            time.sleep(0.05)
        tokens, t0 = 0, time.monotonic()
        for i in range(len(plan["chunks"])):
            try:
                os.close(os.open(d / f"claim_{i}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            stats = run_capture_chunk(d, i, cap, worker=f"e{k}")
            assert stats is not None
            tokens += int(stats["tokens"])
            for f in d.glob("mb_*.safetensors"):  # the trainer's part: consume
                f.unlink(missing_ok=True)
        (d / f"result{k}.json").write_text(json.dumps({"tokens": tokens, "seconds": time.monotonic() - t0}))


def run(cores: list[int], conversations: int, chunk: int, base: Path) -> dict[str, float]:
    d = Path(tempfile.mkdtemp(prefix=f"scaling{len(cores)}-", dir=base))
    prepare(d, conversations, chunk)
    procs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-m", "bench.bench_engine_scaling",
                               "--executor", str(d), str(k), str(c)]) for k, c in enumerate(cores)]
    while not all((d / f"ready{k}").exists() for k in range(len(cores))):
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"an executor failed (logs in {d})")
        time.sleep(0.2)
    t0 = time.monotonic()
    (d / "go").write_text("go")
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"an executor failed (logs in {d})")
    outer = time.monotonic() - t0
    results = [json.loads((d / f"result{k}.json").read_text()) for k in range(len(cores))]
    tokens = sum(int(r["tokens"]) for r in results)
    # the work's wall time is the last executor's own (from the start signal to its last chunk): the engines'
    # shutdown after it (in `outer`) is the same fixed cost for one executor and two, and not capture
    wall = max(float(r["seconds"]) for r in results)
    return {"executors": len(cores), "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "seconds_with_shutdown": outer,
            "busy_tokens_per_s": sum(int(r["tokens"]) / float(r["seconds"]) for r in results)}


def first_step_seconds(run_dir: Path) -> float:
    """Seconds from the trainer's first progress line to its first training step."""
    first = step = None
    for line in (run_dir / "progress.jsonl").read_text().splitlines():
        rec = json.loads(line)
        first = first if first is not None else rec.get("time")
        if rec.get("type") == "metric" and rec.get("step", 0) >= 1:
            step = rec["time"]
            break
    if first is None or step is None:
        raise SystemExit(f"{run_dir}: no training step in progress.jsonl")
    return float(step - first)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--chunk", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--executor", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--first-step", nargs=2, type=Path, default=None, metavar=("SPLIT_RUN", "ONE_WORKER_RUN"))
    a = p.parse_args(argv)
    if a.executor:
        executor(Path(a.executor[0]), int(a.executor[1]), int(a.executor[2]))
        return 0
    if a.first_step:
        split_s, one_s = (first_step_seconds(r) for r in a.first_step)
        print(f"time to the first step: split {split_s:.1f} s, one worker {one_s:.1f} s")
        return 0
    base = a.out or Path(tempfile.mkdtemp(prefix="bench-engine-scaling-"))
    base.mkdir(parents=True, exist_ok=True)
    one = run([0], a.conversations, a.chunk, base)
    two = run([0, 1], a.conversations, a.chunk, base)
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    print(f"one engine on core 0:        {one['tokens']} tokens in {one['seconds']:.1f} s = {one['tokens_per_s']:.0f} tokens/s")
    print(f"two engines on cores 0 and 1: {two['tokens']} tokens in {two['seconds']:.1f} s = {two['tokens_per_s']:.0f} tokens/s")
    print(f"scaling {ratio:.2f}x (goal >= 1.8x): {'met' if ratio >= 1.8 else 'NOT met'}; while both engines were "
          f"busy {two['busy_tokens_per_s'] / one['busy_tokens_per_s']:.2f}x (the last chunk runs on one engine: "
          f"{a.conversations} conversations); with the engines' shutdown "
          f"{(two['tokens'] / two['seconds_with_shutdown']) / (one['tokens'] / one['seconds_with_shutdown']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
