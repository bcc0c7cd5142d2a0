"""Where vLLM is: its interpreter, found without importing it (torch-free; the API's dry run uses it).

vLLM pins other versions of transformers and fastapi than the project, so it lives in its own venv
(`make vllm-env` builds `<repo>/.vllm-venv`); `PEAGLE_VLLM_PYTHON` names another interpreter (the GPU
worker image's CUDA build). A vLLM importable in the current environment counts too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["VLLM_PYTHON_ENV", "vllm_available", "vllm_python"]

#: Environment variable naming the vLLM interpreter.
VLLM_PYTHON_ENV = "PEAGLE_VLLM_PYTHON"

_REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The interpreter that runs vLLM: `PEAGLE_VLLM_PYTHON`, else `<repo>/.vllm-venv/bin/python`, else this
    interpreter when it can import vllm; None when there is none."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    for cand in ([Path(env)] if env else []) + [_REPO / ".vllm-venv" / "bin" / "python"]:
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return None


def vllm_available() -> bool:
    """Whether a vLLM engine can be started from here (`resources.target_engine: auto` resolves by it)."""
    return vllm_python() is not None
