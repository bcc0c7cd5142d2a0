"""COD preparation cost vs one draft forward+backward, on CPU (issue 3).

Measures, for one packed row of T tokens (default T=8192, K=8, r=0.7, r_min=0.2) with a realistic
assistant mask (packed chat documents: user spans unsupervised, assistant spans supervised, a padded
tail):
  * `sample_cod` + `build_flat_row` (the COD draw and flat assembly),
  * the dense CPU mask (`mask_for`) and its one additive float copy (`additive_mask`),
  * `block_mask` built on CPU (the CUDA path; CPU numbers only show it runs),
  * one `PEagleDraft` forward+backward over the same flat row with SDPA and the dense mask
    (SmolLM2-135M dimensions: H=576, 9/3 heads, head_dim 64, I=1536; 1 layer and Vd=8192 by default
    to keep the run within a few GB; the attention over N^2 dominates and does not depend on Vd).
Prints the ratio (preparation / draft step) and writes bench/results/core.json.

    .venv/bin/python bench/bench_core.py [--seq-len 8192] [--layers 1] [--no-draft] [--no-block]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peagle.cod.mask import MAX_DENSE_ELEMENTS, additive_mask, block_mask  # noqa: E402
from peagle.cod.rows import build_flat_row, mask_for  # noqa: E402
from peagle.cod.sampling import sample_cod  # noqa: E402


def realistic_row(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed chat documents: alternating user (mask 0) / assistant (mask 1) spans, padded tail.

    Returns:
        `(input_ids [T], loss_mask [T], document_ids [T])`.
    """
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(t, dtype=torch.long)
    doc = torch.full((t,), -1, dtype=torch.long)
    used = int(t * 0.97)  # ~3 % padding at the end, as a packer leaves
    pos, d = 0, 0
    while pos < used:  # building test data, not library code
        doc_len = min(int(torch.randint(600, 2600, (1,), generator=g)), used - pos)
        end = pos + doc_len
        doc[pos:end] = d
        p = pos
        while p < end:
            user = int(torch.randint(40, 300, (1,), generator=g))
            bot = int(torch.randint(100, 700, (1,), generator=g))
            mask[min(p + user, end) : min(p + user + bot, end)] = 1
            p += user + bot
        pos, d = end, d + 1
    ids = torch.randint(0, 49152, (t,), generator=g)
    return ids, mask, doc


def _time(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def draft_step(row, layers: int, vd: int, mask: torch.Tensor) -> float:
    """Seconds of one draft forward + KL loss + backward over the flat row (SDPA, dense additive mask)."""
    from peagle.cod.loss import cod_loss_sums
    from peagle.model.attention import prepare_dense
    from peagle.model.draft import DraftConfig, PEagleDraft

    cfg = DraftConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_layers=layers,
        vocab_size=49152,
        draft_vocab_size=vd,
        mask_token_id=5,
        max_position_embeddings=16384,
    )
    draft = PEagleDraft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0, 0.02)
        draft.lm_head.weight.normal_(0, 0.02)
    n = row.num_elements
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, n, 3 * 576, generator=g)
    sel = torch.nonzero(row.weight > 0).reshape(-1)
    target = torch.randn(sel.numel(), vd, generator=g)
    t0 = time.perf_counter()
    prepared = prepare_dense(mask, row.ref_pos, row.is_masked)  # as the trainer runs it
    hidden = draft(row.input_ids[None], aux, row.is_masked[None], row.ref_pos[None], prepared)
    logits = draft.compute_logits(hidden[0].index_select(0, sel))
    loss_sum, _ = cod_loss_sums(logits, target, row.weight[sel], row.depth[sel], 8)
    (loss_sum / row.weight.sum()).backward()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--no-block", action="store_true")
    args = ap.parse_args()
    t, k = args.seq_len, args.depths
    ids, lm, doc = realistic_row(t)
    gen = torch.Generator().manual_seed(0)

    t_cod, (anchor, depth) = _time(
        lambda: sample_cod(lm, k, 0.7, 0.2, document_ids=doc, generator=gen), reps=5
    )
    t_flat, row = _time(lambda: build_flat_row(ids, lm, doc, anchor, depth, 5), reps=5)
    n = row.num_elements
    t_dense, dense = _time(lambda: mask_for(row), reps=2)
    t0 = time.perf_counter()
    add = additive_mask(dense)  # [N, N] float32, given to every layer
    t_add = time.perf_counter() - t0
    result: dict = {
        "seq_len": t,
        "num_depths": k,
        "r": 0.7,
        "r_min": 0.2,
        "supervised_fraction": float(lm.float().mean()),
        "documents": int(doc.max()) + 1,
        "flat_elements": n,
        "flat_over_T": n / t,
        "counts_per_depth": torch.bincount(depth, minlength=k).tolist(),
        "max_dense_elements": MAX_DENSE_ELEMENTS,
        "seconds": {
            "sample_cod": t_cod,
            "build_flat_row": t_flat,
            "dense_mask": t_dense,
            "additive_mask": t_add,
        },
        "threads": torch.get_num_threads(),
    }
    prep = t_cod + t_flat + t_dense + t_add
    result["seconds"]["prep_total"] = prep
    if not args.no_block:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_block, _ = _time(lambda: block_mask(anchor, depth, doc, device="cpu"), reps=1)
        result["seconds"]["block_mask_cpu"] = t_block
    del dense
    if not args.no_draft:
        t_step = draft_step(row, args.layers, args.draft_vocab, add)
        result["draft"] = {
            "layers": args.layers,
            "draft_vocab": args.draft_vocab,
            "hidden": 576,
            "heads": "9/3",
        }
        result["seconds"]["draft_fwd_bwd"] = t_step
        result["prep_ratio"] = prep / t_step
        result["cod_only_ratio"] = (t_cod + t_flat) / t_step
        result["target"] = 0.1
        result["pass"] = result["prep_ratio"] < 0.1
        msg = f"prep/step ratio {result['prep_ratio']:.4f} (cod+flat only {result['cod_only_ratio']:.5f})"
    else:
        msg = "draft step skipped"
    out = ROOT / "bench" / "results" / "core.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    sys.stdout.write(json.dumps(result["seconds"], indent=2) + f"\nN={n} ({n / t:.2f} T); {msg}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
