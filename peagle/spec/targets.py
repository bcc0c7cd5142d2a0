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
- a hub id (`is_hub_id`): the hub id;
- anything else (a local folder): `None` (the caller decides).

A hub-shaped name (`name` or `org/name`, `is_hub_id`) is always a hub id, never a folder relative to
the working directory (`peagle.target.loader` fetches it into the hub cache); `target.revision` is a
branch, tag or commit name (`revision_problem`), never a path.

Where something loads the verifier on this machine (the serve check, `peagle eval`), the local folder is
resolved at run time by `peagle.builtin.local_verifier`.
"""

from __future__ import annotations

import re

__all__ = ["BUILTIN_TARGET_HUB_IDS", "NOT_FOR_VLLM", "builtin_of_hub_id", "is_hub_id", "portable_verifier",
           "revision_problem"]

#: A hub repository id: `name` or `org/name` (what huggingface_hub accepts), never a path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
#: A hub revision: a branch, tag or commit name (`main`, `v1.0`, `refs/pr/1`, a commit sha).
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,127}")

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
    return model if is_hub_id(model) else None


def is_hub_id(name: str) -> bool:
    """Whether `name` is a hub repository id (`name` or `org/name`: no other slash, no `..`, not absolute,
    no leading `.` or `~`): such a name is a hub id and never a folder of the working directory."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def revision_problem(revision: str) -> str | None:
    """Why `revision` is not a safe hub revision (a branch, tag or commit name), or None.

    The hub cache reads `refs/<revision>`, so a revision is never a path: no `..`, no leading `/`, no
    backslash, no empty segment, at most 128 characters of letters, digits and `._/-`.
    """
    if (_REVISION.fullmatch(revision) is None or ".." in revision or "//" in revision
            or revision.endswith(("/", "."))):
        return ("must be a branch, tag or commit name (letters, digits and ._/-, starting with a letter, digit "
                f"or _; no '..', no empty path segment, at most 128 characters), got {revision!r}")
    return None


def builtin_of_hub_id(name: str) -> str | None:
    """The builtin target that is the hub model `name` (`HuggingFaceTB/SmolLM2-135M-Instruct` -> builtin)."""
    return next((b for b, hub in BUILTIN_TARGET_HUB_IDS.items() if hub is not None and hub == name), None)
