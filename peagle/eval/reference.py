"""Acceptance length by a pure-PyTorch parallel-drafting reference decoder (docs/algorithm.md 4.1-4.3, docs/decisions.md decision 11).

Greedy speculative decoding, step by step as vLLM does it with parallel drafting:

    prefill:  target(prompt) -> aux g[0..m-1], bonus b = argmax z[m-1]; seq = prompt + [b]
    step:     draft slots  p = 0..m-1: (seq[p+1], g[p], pos p)         (slot m-1 is the bonus slot)
                           i = 1..K-1: (mask_token_id, mask_hidden, pos m-1+i)
              causal attention over these m+K-1 slots; t_k = argmax lm_head(norm(h[m-1+k])) -> target id
              verify:      target([b, t_0..t_{K-1}]) with the KV cache -> y_0..y_K
                           n = longest prefix with t_k == y_k; seq += t_0..t_{n-1}, y_n
                           aux of the n+1 committed positions from this pass; the cache drops the rest

Real-slot features depend only on the prefix, so the draft keeps a KV cache of its real slots, as vLLM
does (`CachedDraftProposer`, used by `evaluate_prompts`): each step runs the draft over the newly
committed slots and the K-1 mask slots only. `DraftProposer` recomputes every slot each step (the
definition; the cached proposer's logits are tested against it). AL = 1 + accepted / drafts pooled over
all prompts, per-position rate_k = drafts with > k accepted / drafts, per-request spread: the one
definition of `peagle.eval.acceptance`, shared with the vLLM probe. The committed tokens are exactly the target's greedy decoding (tested against `generate`).

Prompts are token ids (`peagle.data.prompts`), passed unchanged to vLLM, so both engines decode the
same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from peagle.eval.acceptance import compute_acceptance, histogram_of
from peagle.model.attention import prepare_dense

if TYPE_CHECKING:
    from peagle.model.draft import PEagleDraft

__all__ = [
    "CachedDraftProposer",
    "DecodeResult",
    "DraftProposer",
    "EvalReport",
    "Proposer",
    "TargetStepper",
    "evaluate_prompts",
    "greedy_decode",
    "speculative_decode",
    "summarize",
]

# propose(seq [L] int64, aux [L-1, 3H]) -> K target-vocab token ids (the draft of the step)
Proposer = Callable[[Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------------------
# Target side: KV-cached forward with aux hidden states
# --------------------------------------------------------------------------------------------------


class TargetStepper:
    """Runs the target incrementally with a KV cache and returns logits + concatenated aux states.

    Args:
        model: an HF causal LM (Llama-like; `output_hidden_states` gives the input of each layer).
        aux_layer_ids: 3 layer ids in vLLM's "input of layer" convention (= HF `hidden_states[i]`).
    """

    def __init__(self, model: Any, aux_layer_ids: Sequence[int]) -> None:
        from transformers import DynamicCache

        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens in the cache
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def forward(self, ids: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        """Feed `ids` after the cached prefix.

        Returns:
            (greedy next ids [n] int64, aux [n, 3H] float32) for the n fed positions.
        """
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)  # [1, n]
        n = x.shape[1]
        pos = torch.arange(self.length, self.length + n, device=self.device).view(1, -1)
        out = self.model(
            input_ids=x,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        self.length += n
        hs = out.hidden_states
        aux = torch.cat([hs[i][0] for i in self.aux_layer_ids], dim=-1).float()  # [n, 3H]
        return out.logits[0].argmax(-1), aux

    def crop(self, length: int) -> None:
        """Drop cached positions >= `length` (rejected draft tokens)."""
        drop = self.length - length
        if drop > 0:
            self.cache.crop(-drop)  # negative = remove from the end (old and new transformers alike)
        self.length = length


# --------------------------------------------------------------------------------------------------
# Draft side
# --------------------------------------------------------------------------------------------------


class DraftProposer:
    """Parallel drafting with a `PEagleDraft`: K tokens from one draft forward (docs/algorithm.md 4.1).

    Args:
        draft: the draft (eval mode; any device/dtype).
        num_speculative_tokens: K (bonus slot + K-1 mask slots).
    """

    def __init__(self, draft: PEagleDraft, num_speculative_tokens: int) -> None:
        self.draft = draft
        self.k = int(num_speculative_tokens)
        p = next(draft.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.no_grad()
    def __call__(self, seq: Tensor, aux: Tensor) -> Tensor:
        """seq [L] (last = bonus token, not yet seen by the target), aux [L-1, 3H] -> K target ids [K]."""
        m = seq.numel() - 1  # real slots
        k = self.k
        dev = self.device
        ids = torch.cat([seq[1:].to(dev), torch.zeros(k - 1, dtype=torch.long, device=dev)])  # [m+K-1]
        feats = torch.cat([aux.to(dev, self.dtype), aux.new_zeros(k - 1, aux.shape[-1]).to(dev, self.dtype)])
        is_masked = torch.arange(m + k - 1, device=dev) >= m  # [m+K-1]
        pos = torch.arange(m + k - 1, device=dev)  # real slot p at p; mask slot i at m-1+i
        causal = torch.ones(m + k - 1, m + k - 1, dtype=torch.bool, device=dev).tril()  # [n, n]
        mask = prepare_dense(causal, pos, is_masked)  # the trainer's dense-mask policy
        hidden = self.draft(ids[None], feats[None], is_masked[None], pos[None], mask)  # [1, n, H]
        logits = self.draft.compute_logits(hidden[0, m - 1 :])  # [K, Vd]
        return self.draft.draft_to_target(logits.argmax(-1)).cpu()  # [K]


class CachedDraftProposer(DraftProposer):
    """Parallel drafting with a draft KV cache: `DraftProposer`'s proposals at a fraction of the cost.

    What vLLM does (docs/algorithm.md 4.1): the K/V of every real slot (token seq[p+1], aux g[p], position p)
    depend only on the prefix, so they are computed once, when the slot is committed, and kept per
    layer; each step runs the draft only over the new real slots and the K-1 mask slots (whose K/V are
    never kept). Same layers, same weights (the draft's own submodules), same greedy proposals as the
    full recompute of `DraftProposer` (tested). State is per prompt: `reset()` (called by
    `speculative_decode`); a call whose token prefix does not extend the cached one also starts over.

    Args:
        draft: the draft (eval mode; any device/dtype).
        num_speculative_tokens: K (bonus slot + K-1 mask slots).
    """

    def __init__(self, draft: PEagleDraft, num_speculative_tokens: int) -> None:
        super().__init__(draft, num_speculative_tokens)
        self.reset()

    def reset(self) -> None:
        """Forget the cached slots (a new prompt)."""
        self.kv: list[tuple[Tensor, Tensor]] = []  # per layer: K, V [1, nkv, C, hd] of the C cached slots
        self.tokens = torch.zeros(0, dtype=torch.long)  # seq[: C + 1] the cache was built from

    @torch.no_grad()
    def __call__(self, seq: Tensor, aux: Tensor) -> Tensor:
        """seq [L] (last = bonus token, not yet seen by the target), aux [L-1, 3H] -> K target ids [K]."""
        d, k, dev, dt = self.draft, self.k, self.device, self.dtype
        seq = seq.cpu()
        m = seq.numel() - 1  # real slots
        c = self.tokens.numel() - 1  # cached real slots
        if c < 0 or c >= m or not torch.equal(seq[: c + 1], self.tokens):
            self.reset()
            c = 0
        n = m - c  # new real slots c..m-1 (the last one is the bonus slot)
        h = d.config.hidden_size
        ids = torch.cat([seq[c + 1 :], torch.full((k - 1,), d.config.mask_token_id)]).to(dev)  # [n+K-1]
        pos = torch.arange(c, m + k - 1, device=dev).view(1, -1)  # slot p at p; mask slot i at m-1+i
        proj = d.fc(aux[c:m].to(dev, dt))  # [n, H]
        mask_proj = d.fc(d.mask_hidden).reshape(1, h).expand(k - 1, h)  # [K-1, H]
        hid = torch.cat([proj, mask_proj.to(proj.dtype)]).view(1, n + k - 1, h)  # [1, q, H]
        emb = d.embed_tokens(ids).view(1, n + k - 1, h)
        cos, sin = d.rotary_emb(hid, pos)  # [1, q, hd]
        q_len = n + k - 1
        # query j (slot c+j) sees the C cached slots and the new slots <= c+j
        visible = torch.ones(q_len, c + q_len, dtype=torch.bool, device=dev).tril(diagonal=c)  # [q, C+q]
        x = hid
        new_kv = []
        layers: list[Any] = list(d.layers)  # PEagleFirstLayer, then PEagleLayer
        for i, layer in enumerate(layers):
            if i == 0:
                inp = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hid)], dim=-1)  # [1, q, 2H]
                resid = hid  # un-normalised residual of the fused first layer
            else:
                inp, resid = layer.input_layernorm(x), x
            attn = layer.self_attn
            qh = attn.q_proj(inp).view(1, q_len, attn.num_heads, attn.head_dim).transpose(1, 2)  # [1, nh, q, hd]
            kh = attn.k_proj(inp).view(1, q_len, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            vh = attn.v_proj(inp).view(1, q_len, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
            if c:
                kh = torch.cat([self.kv[i][0], kh], dim=2)  # [1, nkv, C+q, hd]
                vh = torch.cat([self.kv[i][1], vh], dim=2)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, enable_gqa=True)  # [1, nh, q, hd]
            new_kv.append((kh[:, :, : c + n], vh[:, :, : c + n]))  # keep real slots only
            x = resid + attn.o_proj(out.transpose(1, 2).reshape(1, q_len, attn.num_heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.kv = new_kv
        self.tokens = seq.clone()
        logits = d.compute_logits(x[0, n - 1 :])  # bonus slot + K-1 mask slots -> [K, Vd]
        return d.draft_to_target(logits.argmax(-1)).cpu()  # [K]


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


@dataclass
class DecodeResult:
    """One prompt: the generated ids (target-greedy) and the accepted count of every draft."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)


@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    propose: Proposer,
    prompt_ids: Sequence[int],
    *,
    aux_layer_ids: Sequence[int],
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> DecodeResult:
    """Greedy speculative decoding of one prompt with parallel drafting (module docstring).

    Returns:
        `DecodeResult` with at most `max_new_tokens` tokens (ending at the first EOS, included) and
        the number of accepted draft tokens of every verification (counted in full, as vLLM does,
        even where the output is then cut at EOS / max_new_tokens).
    """
    k = int(num_speculative_tokens)
    eos = set(int(e) for e in eos_token_ids)
    reset = getattr(propose, "reset", None)
    if reset is not None:
        reset()  # a cached proposer starts the prompt empty
    stepper = TargetStepper(target, aux_layer_ids)
    nxt, aux = stepper.forward(list(prompt_ids))  # [m], [m, 3H]
    seq = torch.tensor([*prompt_ids, int(nxt[-1])], dtype=torch.long)  # [m+1]
    out = [int(nxt[-1])]
    accepted: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos:
        drafts = propose(seq, aux).to(torch.long).view(-1)[:k]  # [K]
        base = stepper.length
        y, new_aux = stepper.forward([int(seq[-1]), *drafts.tolist()])  # [K+1], [K+1, 3H]
        y = y.cpu()
        match = (drafts == y[:k]).to(torch.long)
        n = int(match.cumprod(0).sum())
        accepted.append(n)
        committed = [*drafts[:n].tolist(), int(y[n])]
        stepper.crop(base + n + 1)
        aux = torch.cat([aux, new_aux[: n + 1]])  # [L-1, 3H]
        seq = torch.cat([seq, torch.tensor(committed, dtype=torch.long)])
        for t in committed:
            out.append(int(t))
            if t in eos or len(out) >= max_new_tokens:
                break
    return DecodeResult(tokens=out[:max_new_tokens], accepted=accepted)


@torch.no_grad()
def greedy_decode(
    target: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Plain greedy decoding, one token per target forward with a KV cache (the reference output)."""
    eos = set(int(e) for e in eos_token_ids)
    stepper = TargetStepper(target, [0, 0, 0])
    nxt, _ = stepper.forward(list(prompt_ids))
    out = [int(nxt[-1])]
    while len(out) < max_new_tokens and out[-1] not in eos:
        nxt, _ = stepper.forward([out[-1]])
        out.append(int(nxt[-1]))
    return out


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalReport:
    """AL and per-position acceptance over a prompt set (`peagle.eval.acceptance`: vLLM's pooled definition;
    AL None when nothing was drafted), the per-request ALs and their spread."""

    acceptance_length: float | None
    per_position: list[float]
    num_drafts: int
    num_accepted_tokens: int
    tokens_generated: int
    num_prompts: int
    num_speculative_tokens: int
    per_request: list[float | None] = field(default_factory=list)
    per_request_spread: dict[str, float] | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    histograms: list[list[int]] = field(default_factory=list, repr=False)  # per request (`acceptance.py`)

    def to_dict(self, *, with_outputs: bool = False) -> dict[str, Any]:
        """JSON-able dict (`outputs` and the per-request `histograms` only when asked)."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("outputs", "histograms")}
        if with_outputs:
            d["outputs"] = self.outputs
            d["histograms"] = self.histograms
        return d


def summarize(results: Sequence[DecodeResult], num_speculative_tokens: int) -> EvalReport:
    """AL = 1 + accepted / drafts and per-position rate_k = P(accepted > k), pooled over all drafts of all
    prompts exactly as vLLM counts them (`compute_acceptance` of each prompt's histogram)."""
    k = int(num_speculative_tokens)
    acc = compute_acceptance([histogram_of(r.accepted, k) for r in results])
    d = acc.to_dict()
    return EvalReport(
        acceptance_length=acc.acceptance_length,
        per_position=acc.per_position,
        num_drafts=acc.num_drafts,
        num_accepted_tokens=acc.num_accepted_tokens,
        tokens_generated=sum(len(r.tokens) for r in results),
        num_prompts=len(results),
        num_speculative_tokens=k,
        per_request=acc.per_request,
        per_request_spread=d["per_request_spread"],
        outputs=[r.tokens for r in results],
        histograms=[histogram_of(r.accepted, k) for r in results],
    )


def evaluate_prompts(
    target: torch.nn.Module,
    draft: PEagleDraft,
    prompts: Sequence[Sequence[int]],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    on_prompt: Callable[[int, DecodeResult], None] | None = None,
) -> EvalReport:
    """Run the reference decoder over tokenised prompts and summarise (AL, per-position, tokens).

    Args:
        target: the target LM (eval mode).
        draft: the draft (eval mode); its config gives the aux layer ids.
        prompts: token ids per prompt (see `peagle.data.prompts.tokenize_prompts`).
        num_speculative_tokens: K at evaluation time (<= trained depths).
        max_new_tokens: per prompt.
        eos_token_ids: generation stops after one of these.
        on_prompt: called after each prompt with (index, result) (progress reporting).
    """
    propose = CachedDraftProposer(draft, num_speculative_tokens)
    results = []
    for i, ids in enumerate(prompts):
        r = speculative_decode(
            target,
            propose,
            ids,
            aux_layer_ids=draft.config.aux_layer_ids,
            num_speculative_tokens=num_speculative_tokens,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
        )
        results.append(r)
        if on_prompt is not None:
            on_prompt(i, r)
    return summarize(results, num_speculative_tokens)
