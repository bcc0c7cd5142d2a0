"""Which decoder measures AL in a run's evaluation, and what the during- and after-training stages share.

The resolved `eval.engine` (`TrainSpec.resolve`) decides: `reference` (the pure-PyTorch decoder,
`peagle.eval.reference`, with the target in this process) or `vllm` (the probe engine in vLLM's venv,
`peagle.engine.prober`; the only choice when `resources.target_engine` is vllm, where the pipeline holds
no target model: `model is None`). Both count AL one way (`peagle.eval.acceptance`).
"""

from __future__ import annotations

from typing import Any

from peagle.errors import ResourceError
from peagle.progress import ProgressSink
from peagle.spec import TrainSpec

__all__ = ["al_str", "decoder_name", "eos_ids", "measuring_engine", "resolved_eval"]


def resolved_eval(spec: TrainSpec) -> TrainSpec:
    """`spec` with `eval.engine` and `checkpoints.select_best_by` decided (idempotent on a resolved spec)."""
    import torch

    from peagle.engine.locate import vllm_available

    return spec.resolve(cuda_available=torch.cuda.is_available(), vllm_available=vllm_available())


def eos_ids(model: Any, tok: Any) -> list[int]:
    """The target's generation EOS ids (its generation config, else the tokenizer's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def al_str(al: Any) -> str:
    """An AL for people: two decimals, or why there is none."""
    return f"{al:.2f}" if isinstance(al, int | float) else "n/a (no drafts)"


def measuring_engine(spec: TrainSpec, model: Any, sink: ProgressSink | None) -> str:
    """The decoder that measures AL: the resolved eval.engine; vLLM missing falls back to the reference
    decoder when the target is in this process (with a warning), else fails.

    Raises:
        ResourceError: vLLM must measure (no target here) but is not installed.
    """
    from peagle.engine.locate import vllm_available

    engine = resolved_eval(spec).eval.engine
    if engine == "vllm" and not vllm_available():
        if model is None:
            raise ResourceError("eval.engine vllm: vLLM is not installed (make vllm-env or PEAGLE_VLLM_PYTHON)")
        if sink is not None:
            sink.event("warning", message="eval.engine vllm: vLLM is not installed, AL measured by the reference "
                                          "decoder instead")  # fmt: skip
        return "reference"
    return "vllm" if engine == "vllm" else "reference"


def decoder_name(engine: str) -> str:
    """`vLLM` or `reference decoder`: the decoder an engine name means, for messages."""
    return "vLLM" if engine == "vllm" else "reference decoder"
