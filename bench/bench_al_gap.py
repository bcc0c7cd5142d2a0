"""Why teacher-forced accuracy overstates served acceptance: the gap taken apart on the same sequences.

A trained draft's held-out `acc_0` (and so `tau_sim`) is higher than the first-token acceptance vLLM
measures. This bench separates the causes on one set of greedy sequences, with the pure-PyTorch reference
decoder (which agrees with vLLM: docs/decisions.md decision 11) and the run's export (bf16 weights as
served), for each prompt set (first N prompts x M new tokens, K = 4):

1. `tf_acc0_restricted`: the training metric (docs/algorithm.md 1.11): draft argmax == the target's argmax
   restricted to the draft vocabulary, at every anchor of the generated answer;
2. `tf_acc0_all`: the same anchors, against the token the target really emits (out-of-vocabulary tokens
   can never be accepted): the gap 1 -> 2 is the vocabulary;
3. `tf_acc0_drafted`: only at the anchors where the decoder drafted a first token (after an accepted
   draft the next position is proposed by a mask slot, so easy stretches are sampled less): the gap
   2 -> 3 is which positions serving asks depth 0 about;
4. `served_rate_0`: the decoder's own first-position acceptance, which 3 must equal (same weights, same
   inputs: a difference would be a train/serve mismatch).

Also `p_ok_after_ok` / `p_ok_after_miss`: depth-0 correctness at the next anchor after a right / wrong
one (the autocorrelation behind 2 -> 3). Writes bench/results/al_gap.json.

    .venv/bin/python -m bench.bench_al_gap [--export RUN/export] [--prompts humaneval,sharegpt-heldout] [--num-prompts 40]

Default export: the demo run `bench_al` trains (trained if missing). Per prompt set, `drafted_vs_served_ratio`
(target 1 within 0.02: teacher forcing where serving drafted equals serving) and `served_vs_training`
(served first-token acceptance / the training metric: how much the metric overstates; reported).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"


def drafted_anchors(prompt_len: int, accepted: list[int], last_anchor: int) -> list[int]:
    """Anchors (real-slot indices) at which a step drafted its first token, given each step's accepted count.

    The first step drafts from the bonus slot `prompt_len - 1`; a step that accepted `n` commits `n + 1`
    tokens, so the next one drafts from `n + 1` slots further. Anchors past `last_anchor` are dropped.

    >>> drafted_anchors(5, [0, 2, 1], 100)
    [4, 5, 8]
    """
    out, a = [], prompt_len - 1
    for n in accepted:
        if a > last_anchor:
            break
        out.append(a)
        a += n + 1
    return out


def depth0_predictions(draft: Any, target: Any, seq: Any, aux_layer_ids: list[int]) -> tuple[Any, Any, Any]:
    """Teacher-forced depth-0 predictions over a whole sequence, as the training forward makes them.

    Real slot `p` (token seq[p+1], aux g[p], position p) predicts seq[p+2]; one target pass gives every aux.

    Args:
        seq: [L] int64 token ids (prompt + answer).

    Returns:
        (pred [L-1] target ids, draft logits [L-1, Vd], target logits [L, V]).
    """
    import torch

    from peagle.model.attention import prepare_dense

    with torch.no_grad():
        out = target(input_ids=seq[None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], -1).float()  # [L, 3H]
        n = seq.numel() - 1
        pos = torch.arange(n)
        plain = torch.zeros(n, dtype=torch.bool)
        mask = prepare_dense(torch.ones(n, n, dtype=torch.bool).tril(), pos, plain)
        hidden = draft(seq[1:][None], aux[:n][None], plain[None], pos[None], mask)  # [1, n, H]
        logits = draft.compute_logits(hidden[0])  # [n, Vd]
    return draft.draft_to_target(logits.argmax(-1)), logits, out.logits[0]


def load(export: Path) -> tuple[Any, Any, Any]:
    """(tokenizer, bf16 target, draft) of an export: the verifier it names, as `peagle eval` loads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.bench_al import verifier_folder
    from peagle.export.writer import load_exported_draft, read_export_config

    verifier = verifier_folder(export, read_export_config(export))
    tok = AutoTokenizer.from_pretrained(verifier)
    target = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.bfloat16).eval()
    return tok, target, load_exported_draft(export).eval()


def measure(tok: Any, target: Any, draft: Any, prompt_set: str, num_prompts: int, max_new_tokens: int,
            k: int) -> dict[str, Any]:
    """The gap on one prompt set (module docstring); served AL and per-position rates as vLLM counts them
    (`peagle.eval.reference.summarize`), over every draft."""
    import torch

    from peagle.data.prompts import load_prompts, tokenize_prompts
    from peagle.eval.reference import CachedDraftProposer, speculative_decode, summarize

    aux_ids = draft.config.aux_layer_ids
    vd = draft.lm_head.weight.shape[0]
    in_vocab = draft.t2d if draft.t2d is not None else torch.ones(target.config.vocab_size, dtype=torch.bool)
    draft_ids = draft.draft_to_target(torch.arange(vd))  # [Vd] target ids
    prompts = tokenize_prompts(tok, load_prompts(prompt_set, num_prompts))
    propose = CachedDraftProposer(draft, k)
    c = {"anchors": 0, "restricted": 0, "all": 0, "covered": 0, "drafts": 0, "drafted_ok": 0, "first_accepted": 0,
         "after_ok": 0, "after_ok_ok": 0, "after_miss": 0, "after_miss_ok": 0}
    results = []
    for ids in prompts:
        r = speculative_decode(target, propose, ids, aux_layer_ids=aux_ids, num_speculative_tokens=k,
                               max_new_tokens=max_new_tokens, eos_token_ids=[tok.eos_token_id])
        results.append(r)
        seq = torch.tensor([*ids, *r.tokens])  # [L]
        length, m = seq.numel(), len(ids)
        if length - 2 < m - 1:
            continue
        pred, logits, target_logits = depth0_predictions(draft, target, seq, aux_ids)  # [L-1], [L-1, Vd], [L, V]
        anchors = torch.arange(m - 1, length - 2)  # the generated answer's anchors
        truth = seq[anchors + 2]
        ok = pred[anchors] == truth
        restricted = target_logits[anchors + 1][:, draft_ids].float().argmax(-1)  # target argmax within Vd
        c["anchors"] += anchors.numel()
        c["all"] += int(ok.sum())
        c["covered"] += int(in_vocab[truth].sum())
        c["restricted"] += int((logits[anchors].argmax(-1) == restricted).sum())
        for a, acc in zip(drafted_anchors(m, r.accepted, length - 3), r.accepted, strict=False):
            c["drafts"] += 1
            c["drafted_ok"] += int(pred[a] == seq[a + 2])
            c["first_accepted"] += int(acc > 0)
        okl = ok.tolist()
        for prev, cur in itertools.pairwise(okl):
            key = "after_ok" if prev else "after_miss"
            c[key] += 1
            c[key + "_ok"] += int(cur)
    d, na = max(c["drafts"], 1), max(c["anchors"], 1)
    served = summarize(results, k)
    return {
        "prompts": len(prompts), "anchors": c["anchors"], "drafts": c["drafts"],
        "tf_acc0_restricted": c["restricted"] / na,
        "tf_acc0_all": c["all"] / na,
        "vocab_coverage": c["covered"] / na,
        "tf_acc0_drafted": c["drafted_ok"] / d,
        "served_rate0_drafted": c["first_accepted"] / d,  # the same scored drafts as tf_acc0_drafted
        "served_rate": served.per_position,
        "served_al": served.acceptance_length,
        "p_ok_after_ok": c["after_ok_ok"] / max(c["after_ok"], 1),
        "p_ok_after_miss": c["after_miss_ok"] / max(c["after_miss"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, default=None, help="a run's export directory (default: the demo run's)")
    ap.add_argument("--prompts", default="humaneval,sharegpt-heldout")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    args = ap.parse_args(argv)
    import torch

    from bench.bench_al import DEMO_RUN, ensure_demo_run

    torch.manual_seed(0)
    if args.export is None:
        ensure_demo_run(DEMO_RUN)
        args.export = DEMO_RUN / "export"
    report: dict[str, Any] = {"export": str(args.export), "k": args.k, "max_new_tokens": args.max_new_tokens}
    tok, target, draft = load(args.export)  # once for every prompt set
    for name in args.prompts.split(","):
        r = measure(tok, target, draft, name, args.num_prompts, args.max_new_tokens, args.k)
        r["drafted_vs_served_ratio"] = r["tf_acc0_drafted"] / max(r["served_rate0_drafted"], 1e-9)
        r["target"] = "1 +- 0.02"
        r["pass"] = abs(r["drafted_vs_served_ratio"] - 1) <= 0.02
        r["served_vs_training"] = r["served_rate"][0] / max(r["tf_acc0_restricted"], 1e-9)
        report[name] = r
        print(f"{name}: acc_0 restricted {r['tf_acc0_restricted']:.4f} -> true token {r['tf_acc0_all']:.4f} "
              f"(coverage {r['vocab_coverage']:.4f}) -> drafted anchors {r['tf_acc0_drafted']:.4f} "
              f"= served {r['served_rate'][0]:.4f} (AL {r['served_al']:.4f}); "
              f"ratio served/restricted {r['served_vs_training']:.3f}; "
              f"P(ok | prev ok) {r['p_ok_after_ok']:.3f}, P(ok | prev miss) {r['p_ok_after_miss']:.3f}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "al_gap.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
