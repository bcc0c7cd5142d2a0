"""Derived spec values, resolved in one place: every `"auto"` and every value the data decides.

    resolved = spec.resolve(cuda_available=torch.cuda.is_available(), target_num_layers=30)

The spec stays torch-free, so the facts a value depends on are passed in: whether CUDA is there (the API
passes `resources.gpus > 0`, the trainer asks torch), the target's depth, and what the data preparation
decided (mask token, draft vocabulary size, optimizer steps). A value whose fact is not given stays as the
user wrote it. The pipeline saves the result as `resolved_spec.json` with the run's provenance.

| field                          | "auto" resolves to                                          |
|--------------------------------|-------------------------------------------------------------|
| resources.device               | cuda when available, else cpu                               |
| resources.precision            | bf16 autocast on cuda, fp32 on cpu                          |
| resources.attention            | flex on cuda, sdpa (dense-mask) on cpu                      |
| target.dtype                   | bfloat16 where the device runs it natively (`device_facts`: a CUDA GPU with bf16, a CPU with avx512_bf16/amx_bf16), else float32; without facts bfloat16 on cuda, float32 on cpu |
| eval.num_speculative_tokens    | peagle.num_depths (None = auto)                             |
| draft.aux_layer_ids            | [2, N//2, N-3] for an N-layer target ([1, N//2, N-1] if N<7)|
| draft.mask_token_id            | what `peagle.data.vocab` picked                             |
| draft.draft_vocab_size, optim.max_steps | what the data gave                                 |
| resources.target_engine        | vllm when vLLM is installed (`vllm_available`), the target is one it runs (`NOT_FOR_VLLM`) and eval.engine is not reference, else hf |
| data.regenerate.engine         | resources.target_engine                                     |
| data.regenerate.enabled        | true when data.regenerate.engine is vllm                    |
| eval.engine                    | vllm when resources.target_engine is vllm, else reference   |
| checkpoints.select_best_by     | acceptance_length when eval.prompt_sets is not empty, else tau_sim |
| resources.capture_gpus / train_gpus | vllm on GPUs: the engine gets tp x dp GPUs when that leaves the trainer one, else both share them all |
| resources.vllm.max_model_len   | data.max_length + data.regenerate.max_new_tokens (or + 1)   |
| resources.vllm.gpu_memory_utilization | 0.9 on GPUs the engine has alone, 0.45 on shared ones |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from peagle.spec.hardware import DeviceFacts, auto_target_dtype
from peagle.spec.targets import NOT_FOR_VLLM

if TYPE_CHECKING:
    from peagle.spec.schema import TrainSpec

__all__ = ["aux_layer_ids", "resolve_spec"]


def aux_layer_ids(requested: list[int] | str, num_layers: int) -> list[int]:
    """Aux layer ids in the vLLM "input of layer i" convention for an N-layer target.

    Raises:
        ValueError: an id outside [0, N), or not 3 distinct ids.
    """
    n = int(num_layers)
    if requested == "auto":
        ids = [2, n // 2, n - 3]
        if len(set(ids)) != 3 and n >= 4:  # too shallow for distinct defaults (the 4-layer tiny target)
            ids = [1, n // 2, n - 1]
    else:
        ids = [int(i) for i in requested]
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ValueError(f"draft.aux_layer_ids must be 3 distinct layer ids for a {n}-layer target, got {ids}")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"draft.aux_layer_ids {bad} outside [0, {n}) for a {n}-layer target (got {ids})")
    return ids


def resolve_spec(
    spec: TrainSpec,
    *,
    cuda_available: bool,
    target_num_layers: int | None = None,
    mask_token_id: int | None = None,
    draft_vocab_size: int | None = None,
    max_steps: int | None = None,
    vllm_available: bool | None = None,
    device_facts: DeviceFacts | None = None,
) -> TrainSpec:
    """A copy of `spec` with its derived values filled in (see the module table); `spec` is unchanged.

    `vllm_available` is whether a vLLM engine can be started here (`peagle.engine.locate.vllm_available`);
    None leaves an `auto` target engine (and what follows from it) as written. `device_facts` is what the
    machine runs natively (`peagle.spec.hardware`); None = a CUDA GPU has bf16, a CPU has not.
    """
    out = spec.model_copy(deep=True)
    r = out.resources
    if r.target_engine == "auto" and vllm_available is not None:
        # the reference decoder runs the target in the trainer process: asking for it keeps the target there
        runs_there = out.target.model not in NOT_FOR_VLLM
        r.target_engine = "vllm" if vllm_available and runs_there and out.eval.engine != "reference" else "hf"
    regen = out.data.regenerate
    if regen.engine == "auto" and r.target_engine != "auto":
        regen.engine = r.target_engine
    if regen.enabled == "auto" and regen.engine != "auto":
        regen.enabled = regen.engine == "vllm"
    if out.eval.engine == "auto" and r.target_engine != "auto":
        out.eval.engine = "vllm" if r.target_engine == "vllm" else "reference"
    if r.target_engine == "vllm":
        v = r.vllm
        if r.gpus > 0 and r.capture_gpus is None:
            want = v.tensor_parallel_size * v.data_parallel_size
            if r.train_gpus is not None:
                r.capture_gpus = r.gpus - r.train_gpus
            else:
                r.capture_gpus = want if want < r.gpus else 0  # 0: the engine shares the trainer's GPUs
        if r.gpus > 0 and r.train_gpus is None:
            r.train_gpus = r.gpus - (r.capture_gpus or 0)
        if v.max_model_len is None:
            # + 1: capture requests generate one token after the longest document
            v.max_model_len = out.data.max_length + (regen.max_new_tokens if regen.enabled is True else 1)
        if v.gpu_memory_utilization is None and r.gpus > 0:
            v.gpu_memory_utilization = 0.9 if r.capture_gpus else 0.45
    if r.device == "auto":
        r.device = "cuda" if cuda_available else "cpu"
    on_cuda = r.device == "cuda"
    if r.precision == "auto":
        r.precision = "bf16" if on_cuda else "fp32"
    if r.attention == "auto":
        r.attention = "flex" if on_cuda else "sdpa"
    if out.target.dtype == "auto":
        facts = device_facts if device_facts is not None else DeviceFacts()
        out.target.dtype = auto_target_dtype(device=r.device, facts=facts)
    if out.checkpoints.select_best_by == "auto":
        out.checkpoints.select_best_by = "acceptance_length" if out.eval.prompt_sets else "tau_sim"
    if out.eval.num_speculative_tokens is None:
        out.eval.num_speculative_tokens = out.peagle.num_depths
    if target_num_layers is not None:
        out.draft.aux_layer_ids = aux_layer_ids(out.draft.aux_layer_ids, target_num_layers)
    if mask_token_id is not None:
        out.draft.mask_token_id = int(mask_token_id)
    if draft_vocab_size is not None:
        out.draft.draft_vocab_size = int(draft_vocab_size)
    if max_steps is not None:
        out.optim.max_steps = int(max_steps)
    return out
