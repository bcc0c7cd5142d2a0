"""The vLLM probe runs with our vLLM plug-ins on its path, so `peagle_tree` ties its engine core to it and
a killed probe (or its guard) leaves nothing of its engine behind (issue 46 item 3; docs/engine.md 3)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest

from peagle.engine import prober
from peagle.engine.server import PLUGINS_DIR
from peagle.errors import ResourceError


def test_the_probe_environment_carries_the_tree_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def loadable(export_dir: Any, verifier: Any, *, workdir: Path) -> Any:
        yield tmp_path

    class Done:
        def wait(self, timeout: float | None = None) -> int:
            return 1

    def guarded(cmd: list[str], *, env: dict[str, str], **kw: Any) -> Done:
        seen["env"] = env
        return Done()

    monkeypatch.setattr(prober, "loadable_export", loadable)
    monkeypatch.setattr(prober, "_plan", lambda *a, **k: {})
    monkeypatch.setattr(prober, "guarded", guarded)
    monkeypatch.setattr(prober.procs, "stop_group", lambda *a, **k: 0)
    with pytest.raises(ResourceError, match="probe failed"):  # no result file: the stand-in wrote none
        prober.run_probe(tmp_path, python=sys.executable, verifier=str(tmp_path))
    assert seen["env"]["PYTHONPATH"] == str(PLUGINS_DIR)
