"""`bench.bench_al_gap`: teacher-forced depth-0 predictions scored at the anchors where decoding drafted.

The bench's claim rests on two things tested here on a tiny fp32 target and draft: the anchors it
reconstructs from the accepted counts are the bonus slots the decoder drafted from, and the one-pass
teacher-forced prediction at such an anchor is exactly the first token the decoder proposed there.
"""

from __future__ import annotations

import torch

from bench.bench_al_gap import depth0_predictions, drafted_anchors
from peagle.eval.reference import CachedDraftProposer, speculative_decode

V, H, N, K = 256, 64, 4, 3
PROMPT = [5, 17, 33, 99, 100, 7]
AUX = [1, 2, 3]


def _models():
    from peagle.builtin import build_tiny_llama
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    target = build_tiny_llama(vocab_size=V, hidden_size=H, num_layers=N, seed=3)
    cfg = DraftConfig.from_target(target.config, num_layers=1, draft_vocab_size=None, mask_token_id=V - 1,
                                  aux_layer_ids=AUX)  # fmt: skip
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    init_from_target(draft, target, None)
    return target, draft.eval()


def test_drafted_anchors_follow_the_accepted_counts():
    assert drafted_anchors(5, [0, 2, 1], 100) == [4, 5, 8]
    assert drafted_anchors(5, [3, 3], 7) == [4]  # anchors past the last scorable one are dropped
    assert drafted_anchors(1, [], 10) == []


def test_teacher_forced_prediction_at_a_drafted_anchor_is_the_decoders_first_draft():
    target, draft = _models()
    proposer = CachedDraftProposer(draft, K)
    first: list[int] = []

    def recording(seq, aux):
        out = proposer(seq, aux)
        first.append(int(out[0]))
        return out

    recording.reset = proposer.reset  # type: ignore[attr-defined]
    r = speculative_decode(target, recording, PROMPT, aux_layer_ids=AUX, num_speculative_tokens=K,
                           max_new_tokens=30)  # fmt: skip
    seq = torch.tensor([*PROMPT, *r.tokens])
    pred, _, _ = depth0_predictions(draft, target, seq, AUX)
    anchors = drafted_anchors(len(PROMPT), r.accepted, seq.numel() - 3)
    assert len(anchors) >= 5
    assert [int(pred[a]) for a in anchors] == first[: len(anchors)]
    # and the acceptance the decoder counted is the teacher-forced correctness there
    assert [int(pred[a] == seq[a + 2]) for a in anchors] == [int(n > 0) for n in r.accepted[: len(anchors)]]
    # a one-off shift of the anchors would score other predictions (the check above can fail)
    assert [int(pred[a + 1]) for a in anchors] != first[: len(anchors)]
