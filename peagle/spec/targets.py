"""What an export names as its verifier: a name that works where the draft is downloaded, not a host path.

The export's `speculators_config.verifier.name_or_path` is what `vllm serve ./draft` loads as the target on
the user's machine, so it must not be a folder of the training host. `portable_verifier` decides it from
the spec alone (torch-free: the API and the pipeline share it):

- `target.name_or_path` when the spec sets it (the user's word wins);
- a builtin target with a hub original: that hub id (`builtin:smollm2-135m-instruct` ->
  `HuggingFaceTB/SmolLM2-135M-Instruct`; the builtin is that model, converted offline from its GGUF);
- a builtin without one (`builtin:tiny-llama`, random weights made by `peagle.builtin`): the builtin name
  itself. No hub holds it; any peagle install rebuilds the same folder (`peagle fixtures`), and vLLM needs
  that folder named explicitly (the long `--speculative-config` form);
- anything else (a hub id, a local folder): as the spec names it (`None`: the caller decides).

Where something loads the verifier on this machine (the serve check, `peagle eval`), the local folder is
resolved at run time by `peagle.builtin.local_verifier`.
"""

from __future__ import annotations

__all__ = ["BUILTIN_TARGET_HUB_IDS", "NOT_FOR_VLLM", "builtin_of_hub_id", "portable_verifier"]

#: Builtin target -> the hub id of the model it is (None: no hub original, e.g. random test weights).
BUILTIN_TARGET_HUB_IDS: dict[str, str | None] = {
    "builtin:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "builtin:tiny-llama": None,
}


#: Builtin targets vLLM cannot run, with the reason: `resources.target_engine: auto` keeps them in
#: transformers, and `vllm` is refused for them.
NOT_FOR_VLLM: dict[str, str] = {
    "builtin:tiny-llama": "its head_dim 16 is refused by vLLM's CPU attention (it needs 32 or more)",
}


def portable_verifier(model: str, name_or_path: str | None = None) -> str | None:
    """The verifier name an export writes for a spec's `target.model` / `target.name_or_path`.

    Returns None when the spec gives no portable name (a hub id or local folder: the caller writes it).
    """
    if name_or_path:
        return name_or_path
    if model in BUILTIN_TARGET_HUB_IDS:
        return BUILTIN_TARGET_HUB_IDS[model] or model
    return None


def builtin_of_hub_id(name: str) -> str | None:
    """The builtin target that is the hub model `name` (`HuggingFaceTB/SmolLM2-135M-Instruct` -> builtin)."""
    return next((b for b, hub in BUILTIN_TARGET_HUB_IDS.items() if hub is not None and hub == name), None)
