"""What a child process (the trainer, a vLLM engine, a probe) may see of its parent's environment.

    env = child_env(extra={"PEAGLE_JOB_ID": job_id})          # the trainer
    env = vllm_env(python=py, devices="3", offline=True)       # a vLLM engine or probe (on child_env)

`child_env` is an ALLOW-list: a child gets only what Python, torch, OpenMP/MKL/oneDNN, CUDA/NCCL,
torchrun, Hugging Face (offline switches, caches), vLLM and the locale read, plus the non-secret
`PEAGLE_*` settings the trainer and the engines read (`CHILD_PEAGLE_VARS`), plus `extra`. Everything else
stays in the worker: the service's secrets and endpoints (`PEAGLE_SECRET_KEY`, `PEAGLE_DATABASE_URL` with
its credentials, `PEAGLE_BROKER_URL`, `PEAGLE_REDIS_URL`, ...) and any name that looks like a credential
(`*_URL`, `*PASSWORD*`, `*SECRET*`, `*TOKEN*`; the Hugging Face hub token `HF_TOKEN` is the one exception,
a target can be a gated hub model the trainer downloads). The proxy and CA-bundle variables pass
(hub downloads behind a proxy).

`sandbox_env` is the environment of a child that parses tenants' bytes (`peagle.engine.sandbox`): far
smaller than `child_env`, no `PEAGLE_*` variable at all, HOME and TMPDIR its own work folder.

`vllm_env` is the one environment every vLLM process is started with (`peagle.engine.server` and
`peagle.engine.prober`): `child_env` without this interpreter's Python settings (vLLM runs in its own
venv), plus vLLM's settings.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["CHILD_PEAGLE_VARS", "SANDBOX_VARS", "child_env", "sandbox_env", "vllm_env"]

#: The non-secret `PEAGLE_*` settings a child reads: the CPU GEMM choice (`peagle.model.cpu_kernels`),
#: vLLM's interpreter (`peagle.engine.locate`), the builtin cache (`peagle.builtin`), the owner's
#: regeneration cache (`peagle.data.regenerate_cache`), the engine's GPUs (`peagle.target.runtime`), the
#: CLI's traceback switch, and the job and attempt the supervisor names.
CHILD_PEAGLE_VARS: tuple[str, ...] = (
    "PEAGLE_CPU_GEMM", "PEAGLE_CPU_FLAGS", "PEAGLE_VLLM_PYTHON", "PEAGLE_CACHE", "PEAGLE_REGEN_CACHE", "PEAGLE_ENGINE_DEVICES",
    "PEAGLE_DEBUG", "PEAGLE_JOB_ID", "PEAGLE_ATTEMPT",
)  # fmt: skip

#: Names passed as they are.
_NAMES = frozenset({
    # process, shell, locale, temp folders
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE", "TMPDIR", "TEMP", "TMP",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
    # Python
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
    "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONIOENCODING", "PYTHONUTF8",
    # oneDNN kernel-cache bounds (peagle.ONEDNN_CACHE_BOUNDS), torch's widest CPU kernels (ATen's dispatch:
    # an AVX-512 machine run as an AVX2 one, docs/testing.md 3), tokenizers, progress bars
    "LRU_CACHE_CAPACITY", "ATEN_CPU_CAPABILITY", "TOKENIZERS_PARALLELISM", "TQDM_DISABLE", "DO_NOT_TRACK",
    # CUDA
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "CUDA_PATH", "CUDA_LAUNCH_BLOCKING",
    "CUDA_MODULE_LOADING", "CUDA_CACHE_PATH", "CUBLAS_WORKSPACE_CONFIG",
    # torchrun / torch.distributed (a rank's engine is started inside a torchrun rank)
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    # Hugging Face
    "HF_TOKEN", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE",
    # proxies and CA bundles (hub downloads)
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    *CHILD_PEAGLE_VARS,
})  # fmt: skip

#: Name prefixes passed (every variable of these libraries).
_PREFIXES = (
    "LC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "TORCH_", "TORCHINDUCTOR_",
    "TORCHDYNAMO_", "TORCHELASTIC_", "PYTORCH_", "NCCL_", "NVIDIA_", "CUDNN_", "TRITON_", "HF_", "VLLM_",
)  # fmt: skip

#: What never passes through `base`, whatever the lists above say (HF_TOKEN excepted, module docstring):
#: `*_URL`, `*PASSWORD*`, `*PASSWD*`, `*SECRET*`, and `TOKEN`/`API_KEY` as a word (`TOKENIZERS_*` passes).
_DENIED = re.compile(r"_URL$|PASSWORD|PASSWD|SECRET|(^|_)(TOKENS?|API_KEY)($|_)")


def _allowed(name: str) -> bool:
    if name != "HF_TOKEN" and _DENIED.search(name.upper()):
        return False
    return name in _NAMES or name.startswith(_PREFIXES)


def child_env(*, extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: the allowed variables of `base`, plus `extra` (module docstring).

    Args:
        extra: added as they are (after the filter; the caller names what the child needs).
        base: the environment to filter; None = `os.environ`.
    """
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items() if _allowed(k)}
    env.update(extra or {})
    return env


#: What a sandboxed child gets of its parent's environment (`sandbox_env`): the program search path, the
#: locale, and what this interpreter needs to import the project (its venv, an explicit PYTHONPATH).
SANDBOX_VARS: tuple[str, ...] = ("PATH", "LANG", "LANGUAGE", "TZ", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH")

#: Set in every sandboxed child: no cwd on the import path (a tenant's `json.py` next to the file it
#: checks is never imported), no user site, no bytecode written, one thread per numeric library, no hub.
_SANDBOX_SET = {
    "PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
    "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
    "TQDM_DISABLE": "1",
}  # fmt: skip


def sandbox_env(home: Path, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed child (`peagle.engine.sandbox.run`): `SANDBOX_VARS` of `base`
    (None = `os.environ`) and `LC_*`, minus anything that looks like a credential, plus HOME and TMPDIR =
    `home` and the fixed Python switches above. Nothing named `PEAGLE_*` passes, secret or not."""
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items()
           if (k in SANDBOX_VARS or k.startswith("LC_")) and not _DENIED.search(k.upper())}  # fmt: skip
    env.update(_SANDBOX_SET, HOME=str(home), TMPDIR=str(home))
    return env


def vllm_env(
    *,
    python: Path | None,
    devices: str | None,
    offline: bool,
    cpu_kv_cache_gb: float = 2.0,
    pythonpath: Sequence[Path] = (),
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
    tmpdir: Path | None = None,
) -> dict[str, str]:
    """The environment of a vLLM process (`vllm serve`, the probe): `child_env` without this venv's Python
    settings (`PYTHON*`, `VIRTUAL_ENV`) and without `TQDM_DISABLE` (vLLM's generate divides by a disabled
    bar's elapsed time, 0), plus vLLM's settings.

    Args:
        python: vLLM's interpreter (on a CPU its venv's `lib/libiomp5.so` is preloaded: vLLM CPU wants
            Intel OpenMP); None = unknown.
        devices: the engine's `CUDA_VISIBLE_DEVICES`; None = a CPU engine, or the inherited devices.
        offline: set `HF_HUB_OFFLINE=1` (the model is a local folder).
        cpu_kv_cache_gb: `VLLM_CPU_KVCACHE_SPACE` unless the environment sets it.
        pythonpath: the only `PYTHONPATH` (vLLM's plug-in modules; never `peagle`).
        extra: added last, as they are.
        base: as `child_env`.
        tmpdir: the engine's own temporary folder (TMPDIR, TEMP, TMP), which its guard removes with it:
            what vLLM and torch leave in the temporary folder (`tmp*`, `vllm_dist_*`) goes with the engine,
            even when it is killed. Torch's compile cache stays where it was (`TORCHINDUCTOR_CACHE_DIR`, by
            default `torchinductor_<user>` in the inherited temporary folder), shared by later engines, and
            so do vLLM's IPC sockets (`VLLM_RPC_BASE_PATH`, a path that must stay short).
    """
    env = {k: v for k, v in child_env(base=base).items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k != "TQDM_DISABLE"}  # fmt: skip
    inherited = env.get("TMPDIR") or tempfile.gettempdir()
    # vLLM's IPC sockets (`VLLM_RPC_BASE_PATH`/<uuid4>) must fit a Unix socket path (107 bytes): in the
    # inherited temporary folder when it leaves room, else in /tmp (a deep TMPDIR failed every engine start)
    env.setdefault("VLLM_RPC_BASE_PATH", inherited if len(inherited.encode()) <= _RPC_BASE_MAX else "/tmp")
    if tmpdir is not None:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(inherited) / f"torchinductor_{_user()}"))
        env.update(TMPDIR=str(tmpdir), TEMP=str(tmpdir), TMP=str(tmpdir))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cpu_kv_cache_gb:g}")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    elif python is not None:
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    env.update(extra or {})
    return env


#: The longest `VLLM_RPC_BASE_PATH` that leaves room for vLLM's socket names: 107 bytes of a Unix socket
#: path, less "/" and a 36-character uuid4.
_RPC_BASE_MAX = 107 - 1 - 36


def _user() -> str:
    """The user name in torch's compile cache folder (`torchinductor_<user>`), spelled as torch spells it."""
    try:
        name = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        name = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", name)
