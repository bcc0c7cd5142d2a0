"""`child_env` passes what the trainer and vLLM need and none of the worker's secrets; `vllm_env` builds on it."""

from __future__ import annotations

from pathlib import Path

from peagle.engine.environment import CHILD_PEAGLE_VARS, child_env, vllm_env

WORKER = {
    # the service's secrets and endpoints
    "PEAGLE_SECRET_KEY": "k" * 40, "PEAGLE_SECRET_KEY_PREVIOUS": "old",
    "PEAGLE_DATABASE_URL": "postgresql+psycopg://peagle:hunter2@db:5432/peagle",
    "PEAGLE_BROKER_URL": "redis://:hunter2@redis:6379/1", "PEAGLE_REDIS_URL": "redis://:hunter2@redis:6379/0",
    "PEAGLE_WEBHOOK_ALLOW_HOSTS": "10.0.0.0/8", "PEAGLE_ARTIFACT_ROOT": "/srv/artifacts",
    "AWS_SECRET_ACCESS_KEY": "s", "GITHUB_TOKEN": "t", "PGPASSWORD": "p", "SENTRY_DSN_URL": "u",
    "VLLM_API_KEY": "v", "RANDOM_THING": "x",
    # what a child needs
    "PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/tmp/x",
    "PYTHONPATH": "/src", "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "4", "OPENBLAS_CORETYPE": "HASWELL",
    "OPENBLAS_L2_SIZE": "1048576", "MKL_NUM_THREADS": "4", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    "LRU_CACHE_CAPACITY": "64", "HF_HOME": "/hf", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "HF_TOKEN": "hf_x", "TORCH_HOME": "/t", "TORCHINDUCTOR_CACHE_DIR": "/ti", "PYTORCH_CUDA_ALLOC_CONF": "x",
    "NCCL_DEBUG": "WARN", "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
    "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "2",
    **{name: "1" for name in CHILD_PEAGLE_VARS},
}  # fmt: skip
SECRET = {"PEAGLE_SECRET_KEY", "PEAGLE_SECRET_KEY_PREVIOUS", "PEAGLE_DATABASE_URL", "PEAGLE_BROKER_URL",
          "PEAGLE_REDIS_URL", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "PGPASSWORD", "SENTRY_DSN_URL", "VLLM_API_KEY"}
NOT_NEEDED = {"PEAGLE_WEBHOOK_ALLOW_HOSTS", "PEAGLE_ARTIFACT_ROOT", "RANDOM_THING"}


def test_child_env_is_an_allow_list() -> None:
    env = child_env(base=WORKER)
    assert not SECRET & set(env) and not NOT_NEEDED & set(env)
    assert env == {k: v for k, v in WORKER.items() if k not in SECRET | NOT_NEEDED}  # everything else passes


def test_extra_is_added_as_given() -> None:
    env = child_env(extra={"PEAGLE_JOB_ID": "j1", "PYTHONUNBUFFERED": "1"}, base={"PEAGLE_SECRET_KEY": "k"})
    assert env == {"PEAGLE_JOB_ID": "j1", "PYTHONUNBUFFERED": "1"}


def test_vllm_env_drops_our_python_and_adds_vllms(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    base = {**WORKER, "VIRTUAL_ENV": "/project/.venv"}
    del base["VLLM_CPU_KVCACHE_SPACE"]
    cpu = vllm_env(python=venv / "bin" / "python", devices=None, offline=True, pythonpath=[tmp_path], base=base)
    assert not SECRET & set(cpu)
    assert cpu["PYTHONPATH"] == str(tmp_path) and "VIRTUAL_ENV" not in cpu and "TQDM_DISABLE" not in cpu
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "2" and cpu["HF_HUB_OFFLINE"] == "1" and cpu["VLLM_NO_USAGE_STATS"] == "1"
    assert cpu["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so") and cpu["CUDA_VISIBLE_DEVICES"] == "0,1"
    gpu = vllm_env(python=venv / "bin" / "python", devices="3", offline=False, extra={"X": "y"}, base=base)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "3" and "LD_PRELOAD" not in gpu and "PYTHONPATH" not in gpu
    assert gpu["X"] == "y" and gpu["HF_HUB_OFFLINE"] == "1"  # inherited from the worker's environment


def test_vllm_env_gives_the_engine_its_own_temporary_folder_and_keeps_torchs_compile_cache(tmp_path: Path) -> None:
    """With `tmpdir`, what vLLM and torch write to the temporary folder lands in the engine's own folder (its
    guard removes it), while torch's compile cache stays in the inherited one, shared by later engines."""
    base = {k: v for k, v in WORKER.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env = vllm_env(python=None, devices=None, offline=True, base=base, tmpdir=tmp_path / "engine")
    assert env["TMPDIR"] == env["TEMP"] == env["TMP"] == str(tmp_path / "engine")
    cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert cache.parent == Path("/tmp/x") and cache.name.startswith("torchinductor_")
    # a compile cache the worker names stays the worker's; without `tmpdir` nothing of it changes
    assert vllm_env(python=None, devices=None, offline=True, base=WORKER, tmpdir=tmp_path)["TORCHINDUCTOR_CACHE_DIR"] == "/ti"
    plain = vllm_env(python=None, devices=None, offline=True, base=base)
    assert plain["TMPDIR"] == "/tmp/x" and "TORCHINDUCTOR_CACHE_DIR" not in plain


def test_vllms_sockets_stay_in_a_short_folder(tmp_path: Path) -> None:
    """vLLM binds its IPC sockets at VLLM_RPC_BASE_PATH/<uuid4>, at most 107 bytes: the inherited temporary
    folder when it is short enough (also when the engine has a folder of its own), else /tmp."""
    env = vllm_env(python=None, devices=None, offline=True, base=WORKER, tmpdir=tmp_path / ("d" * 80))
    assert env["VLLM_RPC_BASE_PATH"] == "/tmp/x"
    deep = {**WORKER, "TMPDIR": "/srv/" + "x" * 70}
    assert vllm_env(python=None, devices=None, offline=True, base=deep)["VLLM_RPC_BASE_PATH"] == "/tmp"
    assert len("/tmp/x/" + "0" * 36) <= 107 < len(deep["TMPDIR"] + "/" + "0" * 36)
