"""The trainer worker's dispatcher reads a split job's protocol files without loading torch (issue 45).

`worker.dispatch` imports of peagle only the torch-free `peagle.split.protocol`; its supervisor ticks it every
heartbeat. Here a fresh interpreter builds a `ChunkDispatcher` on a migrated SQLite database and an empty run
folder (no plan yet: what a trainer that is still preparing its data leaves), ticks it, and finds neither
torch nor transformers loaded and nothing sent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TICK = """
import sys
from pathlib import Path
from types import SimpleNamespace

from service.db import upgrade
from service.db.session import make_engine, make_session_factory
from service.settings import Settings
from worker.dispatch import ChunkDispatcher

tmp = Path(sys.argv[1])
url = f"sqlite:///{tmp / 'db.sqlite'}"
upgrade(url)
engine = make_engine(url)
sent = []
spec = SimpleNamespace(resources=SimpleNamespace(engine=SimpleNamespace(queue=None, replicas=1)))
dispatcher = ChunkDispatcher(Settings(home=tmp / "home", database_url=url), make_session_factory(engine),
                             job_id="j", queue="cpu", run_dir=tmp / "run", spec=spec,
                             send=lambda *args: sent.append(args) or "id")
(tmp / "run").mkdir()
dispatcher.tick()
dispatcher.tick()
engine.dispose()
print(sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules), len(sent))
"""


def test_a_dispatcher_tick_on_an_empty_run_folder_loads_no_torch(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", TICK, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[] 0", out.stdout
