"""Whatever process of an engine dies first, nothing of its tree outlives it (issue 46, item 3).

An engine is the guard, vLLM's API server (`vllm.entrypoints.openai.api_server`), its resource tracker,
its engine core (`VLLM::EngineCore`) and, with `--distributed-executor-backend mp`, a worker
(`VLLM::Worker`, the process a GPU job's workers are). Each slow test starts one engine through
`VllmServer`, kills one of them with SIGKILL and waits: first for the processes below the killed one (tied
to it by `peagle_tree`, our vLLM plug-in: they die with it), then for the whole tree (the processes above a
killed engine core or worker are stopped by vLLM itself, which ends its API server when its engine dies,
and by the guard, which kills the server's group when the server ends). Before the plug-in, a SIGKILLed
guard left the engine core and its worker running under init for good, and a SIGKILLed server left them
running until the guard's SIGTERM had shut them down (8 s).

The fast tests run the plug-in in plain Pythons (no vLLM): a process that loads it dies with its parent,
whether its parent's main thread started it (the death signal) or another thread that ended since (a
thread watching the parent: a death signal would have fired when that thread ended).
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from peagle.engine import procs
from peagle.engine.server import PLUGINS_DIR, EngineConfig, VllmServer
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
#: How long `VllmServer.start` waits for `/health` (its own default): readiness is never a shorter guess.
ENGINE_READY_S = float(inspect.signature(VllmServer).parameters["startup_timeout_s"].default)
#: The processes below a killed one get SIGKILL from the kernel when it ends (a parent-death signal) or
#: from their parent watcher within its 0.2 s poll; a few seconds covers a loaded machine. Before the
#: plug-in, a worker took 3-5 s to notice its killed engine core and exit, and the engine core of a
#: killed server lived 8 s (the guard's SIGTERM shutdown) or for good (a killed guard).
BELOW_S = 2.5
#: The whole tree: vLLM's own reaction to a dead engine core or worker (its API server ends, measured 5 s
#: under load) and the guard's stop of the server's group.
TREE_S = 30.0
#: Processes that need no engine (plain Pythons) may take this long to start under load.
PROCESS_S = 60.0


def _alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _describe(procs: Iterable[psutil.Process]) -> str:
    rows = []
    for p in procs:
        try:
            rows.append(f"{p.pid} {' '.join(p.cmdline())[:90]!r} (parent {p.ppid()})")
        except psutil.Error:
            rows.append(f"{p.pid} (gone)")
    return "; ".join(rows) or "none"


def _wait_gone(procs: list[psutil.Process], timeout: float, what: str) -> float:
    """Wait until none of `procs` is alive; seconds it took. Fails naming `what` and the survivors."""
    t0 = time.monotonic()
    try:
        wait_until(lambda: not _alive(procs), timeout, what, every=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still alive after {timeout:g} s: {_describe(_alive(procs))}") from None
    return time.monotonic() - t0


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _kill_all(procs: Iterable[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()  # psutil checks the process is still the one it saw (no pid reuse)
        except psutil.Error:
            continue


# ---------------------------------------------------------------------------------------------- the plug-in


def test_the_plugin_is_a_vllm_general_plugin_of_the_engines_import_path():
    """vLLM finds general plug-ins by entry point (`vllm.general_plugins`) on its import path: the
    distribution beside the plug-in in `PLUGINS_DIR` (the engine's whole PYTHONPATH) declares it."""
    from importlib.metadata import distributions

    found = [ep for d in distributions(path=[str(PLUGINS_DIR)]) for ep in d.entry_points
             if ep.group == "vllm.general_plugins"]  # fmt: skip
    assert [(ep.name, ep.value) for ep in found] == [("peagle_tree", "peagle_tree:register")]
    assert (PLUGINS_DIR / "peagle_tree.py").is_file()


@pytest.mark.parametrize(("given", "passed"), [(None, None), ("", "peagle_tree"), ("other", "other,peagle_tree"),
                                               ("peagle_tree,other", "peagle_tree,other")])  # fmt: skip
def test_a_vllm_plugins_allow_list_keeps_the_plugin(monkeypatch, tmp_path, given, passed):
    """vLLM loads only the plug-ins `VLLM_PLUGINS` names when it is set: the engine's list names ours."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = () if given is None else (("VLLM_PLUGINS", given),)
    server = VllmServer(
        EngineConfig(model=str(tmp_path), env=env), log_path=tmp_path / "e.log", python=sys.executable
    )
    assert server.environment().get("VLLM_PLUGINS") == passed
    assert server.environment()["PYTHONPATH"] == str(PLUGINS_DIR)


#: A plain Python standing in for a vLLM process: loads the plug-in as vLLM does (`register()`), starts a
#: child (argv[2]: from its main thread or from another thread, each a fresh Python that loads the plug-in as
#: a spawned vLLM process does; or a fork, which loads nothing), waits until the child says how it is tied
#: to its parent, lets the starting thread end, reports both pids and waits.
_TREE = r"""
import os, subprocess, sys, threading, time
from pathlib import Path
import peagle_tree
peagle_tree.register()
report, tied = Path(sys.argv[1]), Path(sys.argv[1] + ".tied")
code = ("import peagle_tree, sys, time; peagle_tree.register(); "
        "open(sys.argv[1], 'w').write(peagle_tree.TIED); time.sleep(600)")
def start():
    global child
    if sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:  # no plug-in load here: only the fork hook
            tied.write_text(str(peagle_tree.TIED))
            time.sleep(600)
            os._exit(0)
    else:
        child = subprocess.Popen([sys.executable, "-c", code, str(tied)]).pid
    while not (tied.exists() and tied.read_text()):
        time.sleep(0.05)
if sys.argv[2] == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()  # the thread that started the child has ended: a parent-death signal would fire now
else:
    start()
Path(f"{report}.tmp").write_text(f"{os.getpid()} {child}")
os.replace(f"{report}.tmp", report)
time.sleep(600)
"""
TIES = {"main": "death signal", "thread": "parent watch", "fork": "death signal"}


@pytest.mark.parametrize("started_from", sorted(TIES))
def test_a_process_that_loads_the_plugin_dies_with_its_parent(tmp_path, started_from):
    env = {**os.environ, "PYTHONPATH": str(PLUGINS_DIR)}
    env.pop("PEAGLE_VLLM_PARENT", None)
    report = tmp_path / "pids"
    # The stand-in for the API server is started like one (its own session, parent-death signal to us).
    root = procs.spawn([sys.executable, "-c", _TREE, str(report), started_from], env=env)
    try:
        wait_until(lambda: report.exists() or root.poll() is not None, PROCESS_S,
                   "the stand-in to start a child that loaded the plug-in")  # fmt: skip
        assert root.poll() is None, f"the stand-in ended with {root.returncode}"
        parent, child = (psutil.Process(int(x)) for x in report.read_text().split())
        tied = Path(f"{report}.tied").read_text()
        assert tied == TIES[started_from], tied
        time.sleep(1.0)
        assert _alive([child]), "the child died although its parent lives (the thread that started it ended)"
        parent.kill()
        took = _wait_gone([child], BELOW_S, "the child of a SIGKILLed stand-in to die with it")
        print(f"started by {started_from}: the child ended {took:.2f} s after its parent")
    finally:
        procs.stop_group(root, grace_s=1.0)


def test_a_child_whose_parent_died_before_it_loaded_the_plugin_ends_itself(tmp_path):
    """vLLM loads general plug-ins seconds after a process starts (after its imports): a child whose parent
    died in between finds itself orphaned when it loads the plug-in, and ends."""
    env = {**os.environ, "PYTHONPATH": str(PLUGINS_DIR), "PEAGLE_VLLM_PARENT": "999999999"}  # no such process
    proc = subprocess.run([sys.executable, "-c", "import peagle_tree; peagle_tree.register(); print('alive')"],
                          env=env, capture_output=True, text=True, timeout=PROCESS_S)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and "alive" not in proc.stdout, (proc.returncode, proc.stderr)


def test_the_root_process_is_not_tied_to_anything():
    """The API server (no vLLM parent: no PEAGLE_VLLM_PARENT) is left as the guard started it, and marks
    itself as the parent of the processes it starts."""
    env = {**os.environ, "PYTHONPATH": str(PLUGINS_DIR)}
    env.pop("PEAGLE_VLLM_PARENT", None)
    code = (
        "import os, peagle_tree; peagle_tree.register(); "
        "print(peagle_tree.TIED, os.environ['PEAGLE_VLLM_PARENT'] == str(os.getpid()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=PROCESS_S)  # fmt: skip
    assert proc.stdout.split() == ["root", "True"], proc.stderr


# ---------------------------------------------------------------------------------------------- real vLLM


class Engine(NamedTuple):
    server: VllmServer
    roles: dict[str, psutil.Process]  # guard, server, engine_core, worker
    tree: list[psutil.Process]  # the guard and all it started, as listed once the engine was ready


@pytest.fixture
def engine(smollm2_path, tmp_path) -> Iterator[Engine]:
    """A real engine with a worker process (`--distributed-executor-backend mp`), and its processes by role."""
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    cfg = EngineConfig(model=str(smollm2_path), dtype="bfloat16", max_model_len=256,
                       extra_args=("--distributed-executor-backend", "mp"))  # fmt: skip
    server = VllmServer(cfg, log_path=tmp_path / "engine.log", startup_timeout_s=ENGINE_READY_S)
    t0 = time.monotonic()
    server.start()
    print(f"engine ready in {time.monotonic() - t0:.0f} s")
    assert server.proc is not None
    guard = psutil.Process(server.proc.pid)
    tree = [guard, *guard.children(recursive=True)]
    try:
        roles = {"guard": guard}
        for p in tree[1:]:
            cmd = " ".join(p.cmdline())
            if "vllm.entrypoints.openai.api_server" in cmd:
                roles["server"] = p
            elif cmd.startswith("VLLM::EngineCore"):
                roles["engine_core"] = p
            elif cmd.startswith("VLLM::Worker"):
                roles["worker"] = p
        assert set(roles) == {"guard", "server", "engine_core", "worker"}, _describe(tree)
        assert roles["engine_core"].ppid() == roles["server"].pid
        assert roles["worker"].ppid() == roles["engine_core"].pid
        # vLLM loaded the plug-in in both, and their parents' main threads started them (the death signal)
        log = server.log_path.read_text(errors="replace")
        for p in (roles["engine_core"], roles["worker"]):
            line = f"peagle_tree: pid {p.pid} dies with its parent {p.ppid()} (death signal)"
            assert line in log, f"{line!r} not in the engine's log"
        yield Engine(server, roles, tree)
    finally:
        server.stop(grace_s=5.0)
        _kill_all(_alive(tree))


@pytest.mark.slow
@pytest.mark.parametrize("role", ["server", "engine_core", "worker", "guard"])
def test_sigkill_of_any_engine_process_leaves_nothing_of_the_engine(engine: Engine, role: str):
    """kill -9 of one process of a running engine: what it started dies with it at once, and the rest of
    the tree (the processes above it, stopped by vLLM and the guard) within seconds."""
    server, roles, tree = engine
    victim = roles[role]
    below = victim.children(recursive=True)
    if role == "guard":
        below = [p for p in tree if p.pid != victim.pid]
    group = roles["server"].pid  # the server leads the group the guard started it in
    assert os.getpgid(roles["engine_core"].pid) == group and os.getpgid(roles["worker"].pid) == group
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        took_below = _wait_gone(below, BELOW_S, f"what the SIGKILLed {role} started to die with it")
    finally:
        left = _alive(tree)
        print(
            f"kill -9 {role}: {len(left)} of the tree alive {time.monotonic() - t0:.2f} s later: {_describe(left)}"
        )
    took_tree = _wait_gone(tree, TREE_S, f"every process of the engine to end after its {role} was SIGKILLed")
    print(f"kill -9 {role}: below gone in {took_below:.2f} s, whole tree in {took_tree:.2f} s")
    # nothing of the engine's process group is left either (also a process vLLM started after the snapshot;
    # zombies waiting for init to reap them hold nothing)
    try:
        wait_until(lambda: not _group(group), TREE_S, "the engine's process group to empty")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_describe(_group(group))}") from None
    if role != "guard":
        assert server.proc is not None and server.proc.poll() is not None  # the guard itself ended
