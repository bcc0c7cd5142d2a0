"""A first SIGTERM before training ends the run with exit 75 even when it lands inside a finalizer.

Python drops an exception raised in a `__del__` (or a weakref callback of the garbage collector): the
early handler's `_EarlyStop` raised there was lost and the run went on to exit 0 (a CI failure of
`test_a_pause_before_training_is_logged_as_a_pause`: the signal landed in `regex`'s `__del__`).
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import os, signal, time
from peagle.cli.run import _EarlyStop, _install_early_interrupt

restore = _install_early_interrupt()
class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside __del__
        sum(range(1000))
try:
    obj = Finalized()
    del obj
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the run goes on with its work; the stop must reach it
        time.sleep(0.01)
    print("lost")
except _EarlyStop as stop:
    print("caught", stop.args[0])
finally:
    restore()
"""


def test_a_stop_raised_inside_a_finalizer_is_delivered_again() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["caught", str(15)], (out.stdout, out.stderr[-2000:])
    assert "_EarlyStop" not in out.stderr  # not reported as an ignored exception either
