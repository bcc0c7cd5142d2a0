"""Target features from a vLLM engine: the 3 aux hidden states and the final state, per document.

`VllmCapture` has the interface of `peagle.target.capture.TargetCapture` (`hidden`, `logits_from_hidden`,
`capture`, `aux_layer_ids`, `head_weight`, ...), so `write_feature_shards` and the batch sources use it
unchanged; the engine replaces the in-process forward:

* the engine (`peagle.engine.server.VllmServer` in capture mode) runs vLLM's `extract_hidden_states` method
  with layer ids ``aux_layer_ids + [N]``: id i is the input of layer i (= transformers'
  ``hidden_states[i]``), id N the last layer's output before the final norm;
* every document of a packed row is one request (its token ids as the prompt, one generated token): in a
  packed row documents never see each other and their positions restart at 0, which is exactly an
  independent request, so the row's features are the documents' features side by side (padding zeros);
* the final state is passed through the target's own final norm here (`peagle.target.parts`), so shards hold
  the same normed `final` as the in-process capture and the target's draft-vocab logits are
  ``lm_head[t2d](final)`` as before.

Equality with the transformers capture is tested (fp32: relative error <= 1e-5; tests/engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.data.packing import document_spans
from peagle.engine.aio import run_sync
from peagle.errors import EngineError
from peagle.target.parts import final_norm

__all__ = ["VllmCapture", "document_spans"]


def _read_states(path: str) -> dict[str, Tensor]:
    """The connector's file, once its writer released the lock; the files are removed after reading."""
    from safetensors.torch import load_file

    lock = Path(path + ".lock")
    try:
        with lock.open() as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the engine's writer releases LOCK_EX
            data = load_file(path, device="cpu")
    except FileNotFoundError:
        data = load_file(path, device="cpu")
    for f in (Path(path), lock):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    return data


class VllmCapture:
    """Feature capture through a running capture-mode engine (module docstring).

    Args:
        server: a started `VllmServer` whose config has `capture.layer_ids == aux_layer_ids + [N]`.
        parts: `load_target_parts(...)` of the same target (final norm and lm_head).
        aux_layer_ids: the 3 aux ids (vLLM convention).
        selected_ids: [Vd] ascending target ids of the draft vocab; None = all V.
        max_in_flight: requests sent at once (the engine batches them).
    """

    def __init__(
        self, server: Any, parts: Any, aux_layer_ids: list[int], selected_ids: Tensor | None = None, *,
        max_in_flight: int = 64,
    ) -> None:
        self.server = server
        self.parts = parts
        self.norm = final_norm(parts)
        self.num_layers = int(parts.config.num_hidden_layers)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        want = (*self.aux_layer_ids, self.num_layers)
        have = tuple(server.config.capture.layer_ids) if server.config.capture else ()
        if have != want:
            raise EngineError(f"capture engine extracts layers {list(have)}, this capture needs {list(want)}")
        head = parts.get_output_embeddings()
        weight = head.weight.detach()  # [V, H]
        self.vocab_size = int(weight.shape[0])
        self.hidden_size = int(weight.shape[1])
        bias = getattr(head, "bias", None)
        if selected_ids is None:
            self.head_weight, self.head_bias = weight, None if bias is None else bias.detach()
        else:
            sel = selected_ids.long()
            self.head_weight = weight.index_select(0, sel).contiguous()  # [Vd, H]
            self.head_bias = None if bias is None else bias.detach().index_select(0, sel)
        self.max_in_flight = max_in_flight
        self.batch_rows = 16  # rows per `hidden` call from `write_feature_shards`: many documents in flight
        self.documents_captured = 0
        self.tokens_captured = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def draft_vocab_size(self) -> int:
        return int(self.head_weight.shape[0])

    # ------------------------------------------------------------------ engine requests

    async def _one(self, client: Any, gate: asyncio.Semaphore, ids: list[int]) -> Tensor:
        import httpx

        body = {"model": self.server.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        async with gate:
            try:
                r = await client.post(f"{self.server.base_url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                self.server.check_alive()
                raise self.server.failure(f"request failed ({type(exc).__name__}: {exc})") from None
        if r.status_code != 200:
            self.server.check_alive()
            raise self.server.failure(f"answered {r.status_code} to a capture request ({r.text[:200]})")
        path = (r.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError("capture engine returned no hidden_states_path (is the connector loaded?)")
        data = await asyncio.to_thread(_read_states, path)
        got = data["token_ids"].tolist()
        if got != ids:
            raise EngineError(f"capture engine returned states of other tokens ({len(got)} vs {len(ids)})")
        return data["hidden_states"]  # [T, 4, H]

    async def _all(self, docs: list[list[int]]) -> list[Tensor]:
        import httpx

        gate = asyncio.Semaphore(self.max_in_flight)
        limits = httpx.Limits(max_connections=self.max_in_flight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
            return list(await asyncio.gather(*(self._one(client, gate, d) for d in docs)))

    # ------------------------------------------------------------------ TargetCapture interface

    @torch.no_grad()
    def hidden(self, input_ids: Tensor, document_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(aux [B, T, 3H], final [B, T, H]) of packed rows, in the engine's dtype, on the CPU; `final` is
        normed by the target's final norm; padding positions are zero."""
        input_ids, document_ids = input_ids.cpu(), document_ids.cpu()
        b, t = input_ids.shape
        where: list[tuple[int, int, int]] = []
        docs: list[list[int]] = []
        for r in range(b):
            for s, e in document_spans(document_ids[r]):
                where.append((r, s, e))
                docs.append(input_ids[r, s:e].tolist())
        states = run_sync(self._all(docs)) if docs else []
        dtype = states[0].dtype if states else self.head_weight.dtype
        h = self.hidden_size
        aux = torch.zeros(b, t, 3 * h, dtype=dtype)  # [B, T, 3H]
        last = torch.zeros(b, t, h, dtype=dtype)  # [B, T, H], before the final norm
        for (r, s, e), st in zip(where, states, strict=True):
            aux[r, s:e] = st[:, :3].reshape(e - s, 3 * h)
            last[r, s:e] = st[:, 3]
        final = self.norm(last.to(self.head_weight.dtype))  # [B, T, H]
        final[document_ids < 0] = 0
        self.documents_captured += len(docs)
        self.tokens_captured += sum(len(d) for d in docs)
        return aux, final

    @torch.no_grad()
    def logits_from_hidden(self, final: Tensor) -> Tensor:
        """Draft-vocab logits [*, Vd] in the head's dtype from final normed hidden states [*, H]."""
        return F.linear(final.to(self.head_weight.dtype), self.head_weight, self.head_bias)

    @torch.no_grad()
    def capture(self, input_ids: Tensor, document_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(aux [B, T, 3H], logits [B, T, Vd]) of packed rows, UNSHIFTED."""
        aux, final = self.hidden(input_ids, document_ids)
        return aux, self.logits_from_hidden(final)
