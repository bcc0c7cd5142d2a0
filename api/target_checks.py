"""What the API can know about a spec's target before queueing, without loading it (torch-free):

- `local_config(model, ...)`: the target's `config.json` when this machine has it: a builtin's fixture
  folder once built (`peagle fixtures`, `PEAGLE_CACHE`), a folder under the model roots, or a hub id's
  snapshot in the hub cache (`HF_HUB_CACHE` / `HF_HOME`, read at call time). None when it is not here.
- `HubProbe.problem(repo_id, revision)`: why a hub id cannot be had by the workers, as far as this machine
  can tell: not in the hub cache AND the hub is off (`HF_HUB_OFFLINE`) or does not answer one short
  request (`timeout_s`), or answers that the model (revision) does not exist. A private or gated model
  (401/403) passes: the workers' token decides. Answers are remembered for `ttl_s`, so a burst of
  submissions costs one request.
- `context_problem(config, max_length)`: `data.max_length` beyond the target's context
  (`max_position_embeddings`).

The API and the workers share the hub cache in embedded mode (`make run`); a deployment whose API cannot
see the workers' cache or network refuses a hub id only when the hub answers that it does not exist, or
when it cannot be reached at all.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from peagle.fileio import read_json
from peagle.spec.targets import is_hub_id

__all__ = ["HubProbe", "context_problem", "hub_cache_dir", "local_config"]

#: Builtin target -> its fixture folder under `PEAGLE_CACHE` (`peagle.builtin`).
_BUILTIN_FOLDERS = {"builtin:smollm2-135m-instruct": "SmolLM2-135M-Instruct", "builtin:tiny-llama": "tiny-llama"}
_TRUE = {"1", "on", "yes", "true"}


def hub_cache_dir() -> Path:
    """The hub cache this process would read (`HF_HUB_CACHE`, else `HF_HOME/hub`, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_hub_config(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(hub_cache_dir()),
                                       revision=revision or "main")
    except ValueError:  # not a valid repo id or revision
        return None
    return Path(found) if isinstance(found, str) else None


def local_config(model: str, revision: str | None = None, *, folder: Path | None = None) -> dict[str, Any] | None:
    """The target's `config.json` as read on this machine (module docstring), or None.

    Args:
        model: `target.model`.
        revision: `target.revision` (hub ids).
        folder: the model's folder when `model` names one the API may read (under the model roots).
    """
    if model in _BUILTIN_FOLDERS:
        root = Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle"))
        built = root / _BUILTIN_FOLDERS[model]
        return read_json(built / "config.json") if (built / ".complete").is_file() else None
    if folder is not None:
        return read_json(folder / "config.json")
    if is_hub_id(model):
        path = _cached_hub_config(model, revision)
        return read_json(path) if path is not None else None
    return None


def context_problem(config: dict[str, Any], max_length: int) -> str | None:
    """Why `data.max_length` does not fit the target's context (`max_position_embeddings`), or None."""
    text = config.get("text_config")
    context = config.get("max_position_embeddings")
    if context is None and isinstance(text, dict):  # multimodal configs nest the language model's
        context = text.get("max_position_embeddings")
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        return None
    if max_length > context:
        return (f"must be <= the target's context of {context} tokens (its config's max_position_embeddings), "
                f"got {max_length}")
    return None


class HubProbe:
    """Whether the workers can fetch a hub model, as far as this machine can tell (module docstring)."""

    def __init__(self, *, timeout_s: float = 3.0, ttl_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._seen: dict[tuple[str, str | None], tuple[float, str | None]] = {}
        self._lock = threading.Lock()

    def problem(self, repo_id: str, revision: str | None) -> str | None:
        """Why `repo_id` (at `revision`) cannot be had, or None (cached, or the hub knows it)."""
        if _cached_hub_config(repo_id, revision) is not None:
            return None
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
            return ("not in the server's hub cache, and the hub is switched off (HF_HUB_OFFLINE): check the id, "
                    "or fetch it on the workers first (`huggingface-cli download ID`)")
        key = (repo_id, revision)
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.ttl_s:
            return seen[1]
        why = self._ask(repo_id, revision)
        with self._lock:
            self._seen[key] = (now, why)
        return why

    def _ask(self, repo_id: str, revision: str | None) -> str | None:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        url = f"{endpoint}/api/models/{repo_id}"
        if revision:
            url += f"/revision/{quote(revision, safe='')}"
        token = os.environ.get("HF_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            r = httpx.get(url, headers=headers, timeout=self.timeout_s, follow_redirects=True)
        except httpx.HTTPError as exc:
            return (f"not in the server's hub cache, and the hub ({endpoint}) cannot be reached "
                    f"({type(exc).__name__}): check the id, or fetch it on the workers first "
                    "(`huggingface-cli download ID`)")
        if r.status_code == 404:
            what = f"revision {revision!r} of {repo_id!r}" if revision else repo_id
            return f"the hub ({endpoint}) has no model {what}: check the id"
        return None  # 200, or 401/403 (private or gated: the workers' token decides), or a hub hiccup
