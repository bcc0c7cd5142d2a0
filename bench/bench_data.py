"""Data/target benchmarks: capture overhead vs a plain forward, and data preparation throughput.

    .venv/bin/python bench/bench_data.py [--rows 2] [--seq 512] [--reps 5] [--convs 10000] [--skip-prep]

1. Capture: the same packed rows through (a) a plain HF forward of SmolLM2 (full-vocab logits, causal),
   (b) `TargetCapture.capture` with the draft vocab (Vd = 8192, the demo preset) and (c) with Vd = V.
   Reported as median seconds and the ratio capture / plain (target <= 1.05).
2. Data prep: 10k ShareGPT conversations (streamed) -> SmolLM2 chat template + assistant masks -> packing,
   with 1 worker and with all cores; conversations/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _medians(fns: dict, reps: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds of each callable, runs interleaved (a shared, noisy CPU drifts equally for all).

    `clock=time.process_time` (CPU seconds of this process) is robust to other processes on a shared
    machine when torch runs 1 thread (--threads 1).
    """
    for fn in fns.values():
        fn()  # warm-up
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            ts[k].append(clock() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_capture(rows: int, seq: int, reps: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.builtin import sharegpt_path, smollm2_dir
    from peagle.data.formats import iter_rows
    from peagle.data.packing import pack_documents
    from peagle.data.template import tokenize_many
    from peagle.target.capture import TargetCapture

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    convs = [r.messages for r in iter_rows(sharegpt_path(), max_samples=200)]
    enc = tokenize_many(tok, convs, max_length=seq // 2, workers=1)
    packed = pack_documents([(e.input_ids, e.loss_mask) for e in enc], seq, seed=0)
    ids, doc = packed.input_ids[:rows], packed.document_ids[:rows]
    print(
        f"capture: SmolLM2-135M fp32 CPU, {rows} packed rows x {seq} tokens "
        f"({int((doc >= 0).sum())} real tokens, {int(doc.max(1).values.sum()) + rows} documents), "
        f"torch threads {torch.get_num_threads()}"
    )
    cap_vd = TargetCapture(model, "auto", torch.arange(0, 49152, 6))  # Vd = 8192
    cap_full = TargetCapture(model, "auto", None)
    with torch.no_grad():
        t = _medians(
            {
                "plain": lambda: model(input_ids=ids, use_cache=False),
                "vd": lambda: cap_vd.capture(ids, doc),
                "full": lambda: cap_full.capture(ids, doc),
                "hs": lambda: model(input_ids=ids, use_cache=False, output_hidden_states=True),
            },
            reps,
            clock=time.process_time if torch.get_num_threads() == 1 else time.perf_counter,
        )
    plain, t_vd, t_full, hs = t["plain"], t["vd"], t["full"], t["hs"]
    unit = "CPU s" if torch.get_num_threads() == 1 else "s"
    print(f"  [{unit}, median of {reps}, interleaved]")
    print(f"  plain forward (full-vocab logits)          {plain:.3f} s")
    print(f"  plain forward + output_hidden_states       {hs:.3f} s  ({hs / plain:.2f}x)")
    print(f"  capture, Vd=8192 (block-causal, 3 aux)     {t_vd:.3f} s  ({t_vd / plain:.2f}x plain)")
    print(f"  capture, Vd=V=49152                        {t_full:.3f} s  ({t_full / plain:.2f}x plain)")


def bench_prep(n: int) -> None:
    from transformers import AutoTokenizer

    from peagle.builtin import sharegpt_path, smollm2_dir
    from peagle.data.formats import IngestReport, iter_rows
    from peagle.data.packing import pack_documents
    from peagle.data.template import tokenize_many

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    t0 = time.perf_counter()
    rep = IngestReport()
    convs = [r.messages for r in iter_rows(sharegpt_path(), "auto", rep, max_samples=n)]
    t_read = time.perf_counter() - t0
    print(
        f"prep: {len(convs)} ShareGPT conversations ({rep.rows_read} read, skipped {dict(rep.skipped_by_reason)}),"
        f" streaming read {t_read:.2f} s ({len(convs) / t_read:.0f} conv/s); cores {os.cpu_count()}"
    )
    for workers in (1, os.cpu_count() or 1):
        t0 = time.perf_counter()
        enc = tokenize_many(tok, convs, max_length=2048, workers=workers)
        rows = pack_documents([(e.input_ids, e.loss_mask) for e in enc if any(e.loss_mask)], 2048, seed=0)
        dt = time.perf_counter() - t0
        toks = sum(len(e.input_ids) for e in enc)
        print(
            f"  template+mask+pack, {workers} worker(s): {dt:.2f} s = {len(convs) / dt:.0f} conv/s, "
            f"{toks / dt / 1e3:.0f}k tok/s -> {len(rows)} rows of 2048 (fill {rows.num_tokens() / rows.input_ids.numel():.3f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--convs", type=int, default=10000)
    ap.add_argument("--skip-prep", action="store_true")
    ap.add_argument("--skip-capture", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 = measure CPU time)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_capture:
        bench_capture(args.rows, args.seq, args.reps)
    if not args.skip_prep:
        bench_prep(args.convs)


if __name__ == "__main__":
    main()
