"""Progress on long commands (issue 39): `peagle train` and `peagle eval` say what they do on stderr while
they run (plain lines when piped, a tqdm bar on a terminal), and a pause is logged as a pause.

The real CLI in a subprocess on the tiny fixture target; stderr is read line by line as it comes.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from peagle.errors import EXIT_CODES
from tests.waiting import wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP spin-waits on a shared CPU


class Peagle:
    """`python -m peagle ARGS` with stdout and stderr piped; stderr lines kept with their arrival time."""

    def __init__(self, *args: str) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "peagle", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=lambda: self.out.extend(self.proc.stdout or []), daemon=True)
        self._out_reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # universal newlines: a bar's carriage returns split lines too
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))

    def wait_for(self, text: str, *, timeout: float = 300) -> float:
        """Seconds after the start at which a stderr line containing `text` came (fails after `timeout`)."""
        end = time.monotonic() + timeout
        while True:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if time.monotonic() >= end or (self.proc.poll() is not None and not self._reader.is_alive()):
                break
            time.sleep(0.1)
        pytest.fail(f"no stderr line with {text!r}; stderr: {[line for _t, line in self.lines][-20:]}")

    def finish(self, *, timeout: float = 600) -> tuple[int, str, float]:
        """(exit code, stdout, seconds after the start at which it ended)."""
        self.proc.wait(timeout=timeout)
        ended = time.monotonic() - self.t0
        self._reader.join(timeout=10)
        self._out_reader.join(timeout=10)
        return self.proc.returncode, "".join(self.out), ended

    def stderr(self) -> list[str]:
        return [line for _t, line in self.lines]


@pytest.fixture(scope="module")
def piped_train(tmp_path_factory, tiny_target_path) -> tuple[Path, Peagle, int, str, float]:
    run = tmp_path_factory.mktemp("progress") / "run"
    p = Peagle("train", "tiny", "--out", str(run))
    rc, out, ended = p.finish()
    return run, p, rc, out, ended


def test_train_piped_prints_progress_lines_while_it_runs(piped_train) -> None:
    _run, p, rc, out, ended = piped_train
    assert rc == 0, p.stderr()[-20:]
    first_t, first = p.lines[0]
    assert first_t < 15 and first.startswith("peagle train tiny"), first  # within seconds, before the ML imports
    for phase in ("validating", "preparing_data", "capturing", "training", "evaluating", "exporting"):
        t = p.wait_for(f"phase {phase}", timeout=0)
        assert t < ended
    steps = [(t, line) for t, line in p.lines if line.startswith("step ")]
    assert steps and steps[-1][1].startswith("step 9/9 (100%)"), p.stderr()  # tiny: 9 optimizer steps
    assert steps[0][0] < ended - 0.5  # step lines come as training runs, not at the end
    ours = [line for line in p.stderr() if not line.startswith("Loading weights")]  # transformers' own bar
    assert all("\x1b" not in line and "%|" not in line for line in ours), ours  # piped: plain lines, no bar
    assert json.loads(out.strip().splitlines()[-1])["export"]  # stdout keeps its one JSON result line


def test_eval_piped_prints_progress_lines(piped_train) -> None:
    run, *_ = piped_train
    p = Peagle("eval", str(run / "export"), "--engine", "reference", "--num-prompts", "2", "--max-new-tokens", "4",
               "--prompts", "humaneval", "--prompts", "sharegpt-heldout")
    rc, out, ended = p.finish()
    assert rc == 0, p.stderr()[-20:]
    assert p.lines[0][1].startswith("peagle eval") and p.lines[0][0] < 15
    t = p.wait_for("reference decoder: prompt set humaneval (2 prompts", timeout=0)
    assert t < ended
    p.wait_for("reference decoder: prompt set sharegpt-heldout: acceptance_length", timeout=0)
    assert out.startswith("acceptance_length ")  # the report stays on stdout


def test_worker_mode_keeps_stderr_for_errors(tmp_path, tiny_target_path) -> None:
    """With the JSON lines on a piped stdout (the worker), stderr carries no progress lines: the supervisor
    files every stderr line in the job log, which has the records already."""
    p = Peagle("train", "tiny", "--out", str(tmp_path / "run"), "--progress-jsonl", "-")
    rc, out, _ = p.finish()
    assert rc == 0, p.stderr()[-20:]
    assert not [line for line in p.stderr() if line.startswith(("phase ", "step ", "peagle train"))]
    assert any(json.loads(line).get("kind") == "phase" for line in out.splitlines())


def test_a_pause_is_logged_as_a_pause_not_an_error(tmp_path, tiny_target_path) -> None:
    """SIGTERM (what the supervisor sends for a pause or a worker shutdown) ends with exit 75 and a line that
    says so; the supervisor files stderr lines that say "error" as errors."""
    spec = tmp_path / "spec.json"
    from peagle.spec import preset

    slow = preset("tiny").model_dump(mode="json")
    slow["optim"]["max_steps"] = 5000  # training runs until the signal
    slow["optim"]["epochs"] = 1000
    spec.write_text(json.dumps(slow))
    p = Peagle("train", str(spec), "--out", str(tmp_path / "run"))
    p.wait_for("step ", timeout=600)
    p.proc.send_signal(signal.SIGTERM)
    rc, _out, _ = p.finish(timeout=300)
    assert rc == EXIT_CODES["interrupted"], p.stderr()[-20:]
    assert not [line for line in p.stderr() if "error" in line.lower()], p.stderr()[-20:]
    assert any(line.startswith("paused at step ") and "pause requested" in line for line in p.stderr())
    assert p.stderr()[-1].startswith("paused at step ") and p.stderr()[-1].endswith("resume with --resume auto")


def test_a_pause_before_training_is_logged_as_a_pause(tmp_path, tiny_target_path) -> None:
    p = Peagle("train", "tiny", "--out", str(tmp_path / "run"))
    p.wait_for("phase validating", timeout=300)
    p.proc.send_signal(signal.SIGTERM)
    rc, _out, _ = p.finish(timeout=300)
    assert rc == EXIT_CODES["interrupted"], p.stderr()[-20:]
    assert not [line for line in p.stderr() if "error" in line.lower()], p.stderr()[-20:]
    assert p.stderr()[-1] == "stopped: pause requested (SIGTERM: a pause or a worker shutdown); resume with " \
                             "--resume auto"


def test_train_on_a_terminal_draws_a_bar(tmp_path, tiny_target_path) -> None:
    """stderr a pty: tqdm draws the training bar (carriage returns, `9/9`)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "peagle", "train", "tiny", "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=follower, env=ENV)  # fmt: skip
    os.close(follower)
    chunks: list[bytes] = []
    end = time.monotonic() + 600
    while time.monotonic() < end:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the pty
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "phase training" in text and "\r" in text
    assert "training: 100%" in text and "9/9" in text, text[-2000:]


def test_the_vllm_probe_gets_a_heartbeat_line_while_it_runs() -> None:
    """The vLLM probe (a sweep starts an engine per K) says nothing until it is done: `peagle eval` logs a
    line every few seconds meanwhile (21 silent minutes in issue 39)."""
    from peagle.cli.evaluate import _heartbeat
    from peagle.progress import RecordingSink

    sink = RecordingSink()

    def beats() -> list[str]:
        return [r["message"] for r in sink.records if r["type"] == "log"]

    # waits for three lines, not 0.9 s by the clock (a loaded machine may starve the thread); a line needs
    # every_s of silence, so no more than one per 0.2 s of the block
    start = time.monotonic()
    with _heartbeat(sink, "vLLM probe", every_s=0.2):
        wait_until(lambda: len(beats()) >= 3, 60, "three heartbeat lines", every=0.05)
    elapsed = time.monotonic() - start
    lines = beats()
    assert 3 <= len(lines) <= elapsed / 0.2 and all(line.startswith("vLLM probe: running for ") for line in lines), lines
    time.sleep(0.4)
    assert len(beats()) == len(lines)  # stops with the block


def test_the_probe_progress_lines_are_forwarded_as_they_come(tmp_path: Path) -> None:
    """`peagle eval --speedup --sweep`: each K, round and batch size the probe starts (its `peagle-probe:` lines,
    amid vLLM's own output in its log) is shown while it runs; a line being written is not cut."""
    from peagle.cli.evaluate import PROBE_PREFIX, _heartbeat
    from peagle.engine.probe import PROGRESS_PREFIX
    from peagle.progress import RecordingSink

    assert PROBE_PREFIX == PROGRESS_PREFIX  # the probe imports no peagle: the two constants must agree
    log = tmp_path / "vllm.log"
    sink = RecordingSink()

    def logs() -> list[str]:
        return [r["message"] for r in sink.records if r["type"] == "log"]

    with _heartbeat(sink, "vLLM probe", every_s=30.0, log=log):
        time.sleep(0.3)
        with log.open("a") as fh:
            fh.write("INFO vllm loading\npeagle-probe: speedup K=1 (1/2), round 1/2, batch size 1\npeagle-probe: half")
            fh.flush()
            # the whole line comes as soon as the thread reads the file; the half line, read with it, waits
            wait_until(lambda: logs() != [], 60, "the probe's first line forwarded", every=0.05)
            assert logs() == ["vLLM probe: speedup K=1 (1/2), round 1/2, batch size 1"]
            fh.write(" a line\n")
        wait_until(lambda: len(logs()) >= 2, 60, "the finished half line forwarded", every=0.05)
    assert logs() == ["vLLM probe: speedup K=1 (1/2), round 1/2, batch size 1", "vLLM probe: half a line"]
