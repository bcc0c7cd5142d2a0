"""Response regeneration: replace assistant turns with the target's own answers.

Drafts accept more when trained on what the target itself would say (docs/algorithm.md 1.2). For each
conversation, assistant turn j is regenerated from the prompt ``conv[:j]`` (whose earlier assistant turns
are already regenerated), greedy (temperature 0) or sampled; user/system turns are kept. Conversations are
processed in batches of `RegenerateSpec.batch_size` (left-padded `generate`), and every finished
conversation is appended to a JSONL cache file named by the spec hash, so an interrupted run resumes and a
second run with the same spec reuses the answers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from peagle.data.template import render

__all__ = ["regenerate_conversations"]


def _load_done(path: Path) -> dict[int, list[dict[str, str]]]:
    done: dict[int, list[dict[str, str]]] = {}
    if not path.exists():
        return done
    with path.open("r", encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a torn last line from an interrupted run
                continue
            done[int(rec["index"])] = rec["messages"]
    return done


@torch.no_grad()
def _generate(
    model: Any, tokenizer: Any, prompts: list[str], cfg: Any, max_prompt: int, gen: torch.Generator
) -> list[str]:
    side, trunc = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side = tokenizer.truncation_side = "left"  # keep the end of long prompts
    try:
        enc = tokenizer(
            prompts,
            add_special_tokens=False,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=max_prompt,
        )
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = side, trunc
    dev = next(model.parameters()).device
    enc = {k: v.to(dev) for k, v in enc.items()}
    kwargs: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if cfg.temperature > 0:
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=1.0, top_k=0)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, **kwargs)  # [B, P + new]
    new = out[:, enc["input_ids"].shape[1] :]
    return [s.strip() for s in tokenizer.batch_decode(new, skip_special_tokens=True)]


def regenerate_conversations(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[list[dict[str, str]]],
    cfg: Any,
    cache_file: str | Path,
    *,
    max_length: int,
    seed: int = 0,
    sink: Any = None,
) -> list[list[dict[str, str]]]:
    """Conversations with every assistant turn replaced by the target's answer (same order).

    Args:
        model: the target (HF causal LM with ``generate``).
        tokenizer: its tokenizer (chat template, pad token).
        conversations: normalised conversations.
        cfg: `peagle.spec.RegenerateSpec` (temperature, max_new_tokens, batch_size).
        cache_file: JSONL cache; name it by `peagle.spec.spec_hash` of what produced it.
        max_length: prompts are truncated to this many tokens (left side kept).
        seed: sampling seed (temperature > 0).
    """
    cache = Path(cache_file)
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = _load_done(cache)
    gen = torch.Generator().manual_seed(seed)
    todo = [i for i in range(len(conversations)) if i not in done]
    was_training = model.training
    model.eval()
    try:
        with cache.open("a", encoding="utf-8") as fh:
            for b in range(0, len(todo), cfg.batch_size):
                batch = todo[b : b + cfg.batch_size]
                convs: dict[int, list[dict[str, str]]] = {i: [] for i in batch}
                pending = {i: list(conversations[i]) for i in batch}
                # advance all conversations of the batch turn by turn
                while any(pending.values()):
                    ask: list[int] = []
                    for i in batch:
                        while pending[i] and pending[i][0]["role"] != "assistant":
                            convs[i].append(pending[i].pop(0))
                        if pending[i]:
                            ask.append(i)
                    if not ask:
                        break
                    prompts = [render(tokenizer, convs[i], add_generation_prompt=True) for i in ask]
                    answers = _generate(model, tokenizer, prompts, cfg, max_length, gen)
                    for i, ans in zip(ask, answers, strict=True):
                        pending[i].pop(0)
                        convs[i].append({"role": "assistant", "content": ans})
                for i in batch:
                    fh.write(json.dumps({"index": i, "messages": convs[i]}) + "\n")
                    done[i] = convs[i]
                fh.flush()
                os.fsync(fh.fileno())
                if sink is not None:
                    sink.log("info", f"regenerated {len(done)}/{len(conversations)} conversations")
    finally:
        model.train(was_training)
    return [done[i] for i in range(len(conversations))]
