"""`peagle.engine.sandbox` on real processes: an allow-listed environment, and each limit (address space, CPU
time, file size, wall clock) stops the child with a refusal that names it; the child's whole group goes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from peagle.engine.environment import sandbox_env
from peagle.engine.sandbox import Limits, run
from tests.waiting import processes_mentioning, wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="rlimits, process groups: Linux")

ROOMY = Limits(memory_bytes=2 * 1024**3, cpu_seconds=60, file_bytes=64 * 1024**2, wall_seconds=60.0)

#: What the API process's environment holds: the service's secrets and endpoints among ordinary variables.
API_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/root",
    "PEAGLE_SECRET_KEY": "s3cret-key-of-at-least-32-characters!!", "PEAGLE_SECRET_KEY_PREVIOUS": "old-s3cret",
    "PEAGLE_DATABASE_URL": "postgresql+psycopg://peagle:pw@db/peagle", "PEAGLE_BROKER_URL": "redis://:pw@redis/0",
    "PEAGLE_REDIS_URL": "redis://:pw@redis/1", "PEAGLE_WEBHOOK_ALLOW_HOSTS": "10.0.0.0/8",
    "PEAGLE_HOME": "/srv/peagle", "PEAGLE_DATASET_ROOT": "/srv/peagle/datasets", "PEAGLE_CPU_GEMM": "onednn",
    "AWS_SECRET_ACCESS_KEY": "aws", "GITHUB_TOKEN": "ghp", "HF_TOKEN": "hf_x", "SOME_API_KEY": "k",
}  # fmt: skip


def _in_a_fresh_thread(coro: Any) -> Any:
    """`asyncio.run(coro)` in a thread of its own: the test session's main thread may have a loop marked as
    running already (Playwright's sync API keeps its loop so), where `asyncio.run` refuses to start."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _run(code: str, tmp_path: Path, limits: Limits = ROOMY, **kw: object):
    return _in_a_fresh_thread(run([sys.executable, "-c", code], cwd=tmp_path, limits=limits, **kw))  # type: ignore[arg-type]


def test_the_child_sees_only_the_allow_list_and_home_is_its_work_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = _run("import json, os, sys; print(json.dumps({'env': dict(os.environ), 'path': sys.path}))", tmp_path,
               home=home, base_env=API_ENV)
    assert out.breach is None and out.returncode == 0, out
    seen = json.loads(out.stdout)
    env = seen["env"]
    assert not [k for k in env if k.startswith("PEAGLE_")], env  # no secret, no endpoint, no setting at all
    assert not set(env) & {"AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "HF_TOKEN", "SOME_API_KEY"}, env
    assert env["HOME"] == str(home) and env["TMPDIR"] == str(home) and home.is_dir()
    assert env["PATH"] == API_ENV["PATH"] and env["LANG"] == "C.UTF-8"
    assert env["PYTHONSAFEPATH"] == "1"  # the work folder (tenant files) is never on the import path
    assert str(tmp_path) not in seen["path"] and "" not in seen["path"]
    assert env == sandbox_env(home, base=API_ENV)  # exactly the allow-list's environment, nothing inherited


def test_an_import_of_a_tenant_file_in_the_work_folder_does_not_run_it(tmp_path: Path) -> None:
    (tmp_path / "json.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    out = _in_a_fresh_thread(run([sys.executable, "-m", "json.tool", "--help"], cwd=tmp_path, limits=ROOMY))
    assert out.returncode == 0, out
    assert not (tmp_path / "ran").exists()


def test_an_address_space_breach_is_refused_naming_the_memory_limit(tmp_path: Path) -> None:
    limits = Limits(memory_bytes=256 * 1024**2, cpu_seconds=60, file_bytes=1024**2, wall_seconds=60.0)
    out = _run("b = bytearray(1 << 30)", tmp_path, limits)
    assert out.breach == "memory", out
    assert out.message == "validation stopped: it exceeded the 256 MiB memory limit"


def test_a_cpu_time_breach_is_refused_naming_the_cpu_limit(tmp_path: Path) -> None:
    limits = Limits(memory_bytes=1024**3, cpu_seconds=1, file_bytes=1024**2, wall_seconds=60.0)
    t0 = time.monotonic()
    out = _run("while True: pass", tmp_path, limits, what="dataset validation")
    assert out.breach == "cpu", out
    assert out.message == "dataset validation stopped: it exceeded the CPU time limit of 1 s"
    assert time.monotonic() - t0 < 30


def test_a_file_size_breach_is_refused_naming_the_file_size_limit(tmp_path: Path) -> None:
    limits = Limits(memory_bytes=1024**3, cpu_seconds=60, file_bytes=1024**2, wall_seconds=60.0)
    out = _run("open('big', 'wb').write(b'x' * (4 << 20))", tmp_path, limits)
    assert out.breach == "file_size", out
    assert out.message == "validation stopped: it exceeded the 1 MiB file-size limit"
    assert (tmp_path / "big").stat().st_size <= 1024**2


def test_a_wall_clock_breach_kills_the_childs_whole_group(tmp_path: Path) -> None:
    marker = f"sandbox-wall-{os.getpid()}"
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
            "time.sleep(600)\n")
    limits = Limits(memory_bytes=1024**3, cpu_seconds=60, file_bytes=1024**2, wall_seconds=1.5)
    t0 = time.monotonic()
    try:
        out = _run(code, tmp_path, limits)
        assert out.breach == "wall_clock", out
        assert out.message == "validation stopped: it exceeded the wall-clock limit of 1.5 s"
        assert time.monotonic() - t0 < 20
        wait_until(lambda: not processes_mentioning(marker), 10, "the grandchild to be killed with its group")
    finally:
        for pid in processes_mentioning(marker):
            os.kill(pid, signal.SIGKILL)


def test_an_ordinary_failure_is_no_breach(tmp_path: Path) -> None:
    out = _run("import sys; print('{\"ok\": false}'); sys.exit(4)", tmp_path)
    assert out.breach is None and out.message is None and out.returncode == 4
    assert out.stdout.strip() == b'{"ok": false}'


def test_spawn_takes_the_same_limits_hook() -> None:
    import subprocess

    from peagle.engine.procs import spawn
    from peagle.engine.sandbox import limits_hook

    limits = Limits(memory_bytes=512 * 1024**2, cpu_seconds=7, file_bytes=3 * 1024**2, wall_seconds=60.0)
    proc = spawn([sys.executable, "-c", "import resource as r; print(r.getrlimit(r.RLIMIT_AS)[0], "
                  "r.getrlimit(r.RLIMIT_CPU)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], r.getrlimit(r.RLIMIT_CORE)[1])"],
                 env=sandbox_env(Path("/tmp")), stdout=subprocess.PIPE, text=True, preexec=limits_hook(limits))
    out, _ = proc.communicate(timeout=30)
    assert out.split() == [str(512 * 1024**2), "7", str(3 * 1024**2), "0"]


def test_a_child_killed_from_outside_is_a_named_refusal_not_a_crash(tmp_path: Path) -> None:
    """SIGKILL that is not the wall clock's (the CPU limit's hard stop, the host's OOM killer) is reported as
    such: an upload is never answered "internal error"."""
    out = _run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    assert out.returncode == -signal.SIGKILL and out.breach == "killed", out
    assert out.message is not None and "was killed" in out.message and "out-of-memory" in out.message
