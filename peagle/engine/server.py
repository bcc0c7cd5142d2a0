"""A `vllm serve` process for the target: started, health-checked and always stopped.

    cfg = EngineConfig(model="/models/llama", dtype="bfloat16", max_model_len=4096)
    with VllmServer(cfg, log_path=run / "logs" / "engine-regenerate.log") as server:
        httpx.post(f"{server.base_url}/v1/completions", json={"model": server.served_name, ...})

The engine runs in vLLM's own interpreter (`peagle.engine.locate.vllm_python`; vLLM pins other library
versions than the project) as an OpenAI-compatible server on a free loopback port, under `guard.py`,
which owns its process group and takes it down when the server is stopped, when the process that
started it dies (even by SIGKILL), or when the engine exits on its own. Inside the engine, our vLLM
general plug-in (`vllm_plugins/peagle_tree.py`) ties every process vLLM starts (engine core, workers) to
its parent, so a SIGKILLed server or guard takes the rest down with it. So no engine process outlives a
cancelled, paused, crashed or killed job, whichever of its processes dies first
(tests/engine/test_engine_lifecycle.py, tests/engine/test_engine_tree.py).

Placement: `devices` becomes the engine's `CUDA_VISIBLE_DEVICES` (its share of the job's GPUs; vLLM runs
`tensor_parallel_size` x `data_parallel_size` workers over them); on a CPU the engine shares the cores
with the trainer (`VLLM_CPU_KVCACHE_SPACE` GB of KV cache, eager mode).

Capture mode (`EngineConfig.capture`) adds vLLM's `extract_hidden_states` speculative method and our
hidden-states connector (`vllm_plugins/peagle_hidden_states.py`, loaded through vLLM's
`kv_connector_module_path` plug-in point), so every request's prompt hidden states at the given layer ids
are written to `capture.storage_dir` and the path comes back in the response's `kv_transfer_params`.
Prefix caching is off in that mode: a cached prefix would be served without running the layers again.

Failures raise `EngineError` naming the command, the reason (exit code, timeout) and the last lines of
the engine's log.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from peagle.engine import procs
from peagle.engine.environment import vllm_env
from peagle.engine.guard import guarded
from peagle.engine.locate import vllm_python
from peagle.errors import EngineError

__all__ = ["CaptureOptions", "EngineConfig", "VllmServer", "engine_config_from_spec", "log_tail"]

PLUGINS_DIR = Path(__file__).resolve().with_name("vllm_plugins")
#: Seconds the guard gives the engine's group between SIGTERM and SIGKILL.
GRACE_S = 20.0
#: The name the engine serves the target under (requests name it in `model`).
SERVED_NAME = "target"
CONNECTOR = "PeagleHiddenStatesConnector"
CONNECTOR_MODULE = "peagle_hidden_states"
#: Our vLLM general plug-in (`vllm_plugins/peagle_tree.py`): vLLM's processes die with their parents.
TREE_PLUGIN = "peagle_tree"


@dataclass(frozen=True)
class CaptureOptions:
    """Hidden-state capture: vLLM layer ids (the input of layer i; id N = the last layer's output before
    the final norm) and where the per-request files go."""

    layer_ids: tuple[int, ...]
    storage_dir: Path


@dataclass(frozen=True)
class EngineConfig:
    """What `vllm serve` is started with (`engine_config_from_spec` builds it from a resolved job spec)."""

    model: str
    dtype: str = "auto"
    revision: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    extra_args: tuple[str, ...] = ()
    seed: int = 0
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of the engine; None = CPU (or inherit)
    capture: CaptureOptions | None = None
    cpu_kv_cache_gb: float = 2.0
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def engine_config_from_spec(
    resolved: Any, model: str | Path, *, capture: CaptureOptions | None = None, devices: str | None = None
) -> EngineConfig:
    """The engine of a resolved `TrainSpec` (`resources.vllm`, `target.dtype`/`revision`, `optim.seed`).

    Args:
        resolved: `spec.resolve(...)` with the target engine resolved to vllm.
        model: the local folder (or hub id) vLLM loads.
        capture: hidden-state capture options (None = generation only).
        devices: the engine's GPUs as a `CUDA_VISIBLE_DEVICES` string; None on a CPU job.
    """
    v = resolved.resources.vllm
    dtype = resolved.target.dtype
    return EngineConfig(
        model=str(model),
        dtype="auto" if dtype == "auto" else dtype,
        revision=resolved.target.revision,
        max_model_len=v.max_model_len,
        tensor_parallel_size=v.tensor_parallel_size,
        data_parallel_size=v.data_parallel_size,
        gpu_memory_utilization=v.gpu_memory_utilization if devices is not None else None,
        extra_args=tuple(v.extra_args),
        seed=resolved.optim.seed,
        devices=devices,
        capture=capture,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 12) -> list[str]:
    """The last `lines` non-empty lines of an engine log, errors first kept (a traceback's last line names
    the reason; vLLM's INFO chatter is dropped when there are enough other lines)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    rows = [r.rstrip() for r in text.splitlines() if r.strip()]
    useful = [r for r in rows if " INFO " not in r and "DeprecationWarning" not in r and "warnings.warn" not in r]
    return (useful or rows)[-lines:]


class VllmServer:
    """One `vllm serve` process (module docstring). Use as a context manager, or `start()` / `stop()`.

    Args:
        config: the engine's settings.
        log_path: where the engine's stdout and stderr go (its tail is quoted in errors).
        python: vLLM's interpreter; None = `vllm_python()`.
        startup_timeout_s: how long `start()` waits for `/health`.
        name: a word for messages (`regeneration engine`, `capture engine`).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_path: str | Path,
        python: str | Path | None = None,
        startup_timeout_s: float = 1800.0,
        name: str = "vLLM engine",
    ) -> None:
        self.config = config
        self.log_path = Path(log_path)
        self.python = Path(python) if python is not None else vllm_python()
        self.startup_timeout_s = startup_timeout_s
        self.name = name
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.served_name = SERVED_NAME
        self.started_s: float | None = None

    # ------------------------------------------------------------------ command line and environment

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The `vllm serve` command line (without the guard)."""
        c = self.config
        if self.python is None:
            raise EngineError(
                f"{self.name}: vLLM is not installed: run `make vllm-env` (builds .vllm-venv, about 2 minutes) "
                "or set PEAGLE_VLLM_PYTHON to a Python that imports vllm"
            )
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", c.model, "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", c.dtype, "--seed", str(c.seed),
            "--tensor-parallel-size", str(c.tensor_parallel_size),
            "--data-parallel-size", str(c.data_parallel_size),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if c.revision:
            cmd += ["--revision", c.revision]
        if c.max_model_len:
            cmd += ["--max-model-len", str(c.max_model_len)]
        if c.devices is None:
            cmd += ["--enforce-eager"]  # CPU: no graphs to capture, and compilation costs minutes
        elif c.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.capture is not None:
            ids = [int(i) for i in c.capture.layer_ids]
            cmd += [
                "--no-enable-prefix-caching",
                "--speculative-config", json.dumps({
                    "method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                }),
                "--kv-transfer-config", json.dumps({
                    "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(c.capture.storage_dir)},
                }),
            ]  # fmt: skip
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        """The engine's environment (`peagle.engine.environment.vllm_env`: the allowed variables, no secret
        of the worker, none of this venv's Python settings; our vLLM plug-ins as its only PYTHONPATH, and
        `peagle_tree` added to a `VLLM_PLUGINS` allow-list when one is given)."""
        c = self.config
        env = vllm_env(python=self.python, devices=c.devices, offline=Path(c.model).is_dir(),
                       cpu_kv_cache_gb=c.cpu_kv_cache_gb, pythonpath=[PLUGINS_DIR], extra=dict(c.env))
        allowed = env.get("VLLM_PLUGINS")  # vLLM loads only the plug-ins named there when it is set
        if allowed is not None and TREE_PLUGIN not in allowed.split(","):
            env["VLLM_PLUGINS"] = f"{allowed},{TREE_PLUGIN}" if allowed else TREE_PLUGIN
        return env

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> VllmServer:
        """Start the engine and wait until `/health` answers 200.

        Raises:
            EngineError: vLLM missing, the engine exited, or it was not ready within `startup_timeout_s`.
        """
        import httpx

        if self.proc is not None:
            return self
        self.port = _free_port()
        cmd = self.command()
        if self.config.capture is not None:
            self.config.capture.storage_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            self.proc = guarded(cmd, env=self.environment(), grace_s=GRACE_S, stdout=log, stderr=subprocess.STDOUT)
        deadline = t0 + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    rc = self.proc.returncode
                    self.proc = None
                    raise self._error(f"exited with code {rc} while starting", cmd)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    self.stop()
                    raise self._error(f"was not ready within {self.startup_timeout_s:.0f} s", cmd)
                time.sleep(0.5)
        self.started_s = time.monotonic() - t0
        return self

    def check_alive(self) -> None:
        """Raise `EngineError` when the engine has exited (call between requests)."""
        if self.proc is None:
            raise EngineError(f"{self.name} is not running")
        if self.proc.poll() is not None:
            rc = self.proc.returncode
            self.proc = None
            raise self._error(f"exited with code {rc}", self.command())

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the engine and everything it started (idempotent). SIGTERM to the guard, which takes the
        engine's group down; SIGKILL to the guard's own group after `grace_s`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        procs.stop_group(proc, grace_s=grace_s)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def failure(self, reason: str) -> EngineError:
        """An `EngineError` for a failure seen by a client of the running engine (an error answer): the
        reason, the command and the last lines of the engine's log, which usually say why."""
        if self.proc is not None and self.proc.poll() is not None:
            reason += f" (the engine exited with code {self.proc.returncode})"
        return self._error(reason, self.command())

    def _error(self, reason: str, cmd: Sequence[str]) -> EngineError:
        tail = log_tail(self.log_path)
        return EngineError(
            f"{self.name} {reason}: `{shlex.join(cmd)}`; last lines of its log ({self.log_path.name}): "
            + " | ".join(tail)
        )
