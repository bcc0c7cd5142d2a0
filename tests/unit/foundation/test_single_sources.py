"""Each contract is spelled in one place: the checks that keep copies from coming back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from peagle.spec import PHASES
from peagle.spec.metrics import acc_key, al_pos_key, al_pos_values, eval_key, is_eval_key, is_measured_al_key

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("peagle", "service", "api", "worker")


def _code(text: str) -> str:
    """The module's code without comments and docstrings (prose may name a contract; code may not)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body[0] = ast.Pass()
    return ast.unparse(tree)


def _sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): _code(p.read_text(encoding="utf-8"))
            for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _where(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted(name for name, text in _sources().items() if rx.search(text))


def test_job_event_rows_have_one_writer() -> None:
    assert _where(r"insert\(JobEvent\)|JobEvent\(") == ["service/db/events.py", "service/db/models.py"]


def test_live_channel_and_dataset_prefix_are_named_once() -> None:
    assert _where(r"peagle:job:") == ["service/channels.py"]
    assert _where(r"[\"']dataset:[\"'{]") == ["peagle/spec/schema.py"]


def test_metric_key_builders_are_defined_once() -> None:
    assert _where(r"f[\"'](al_pos|acc|eval)_\{") == []  # built by peagle.spec.metrics only
    assert (acc_key(2), eval_key("loss"), al_pos_key(1)) == ("acc_2", "eval_loss", "al_pos_1")
    assert al_pos_values([0.5, 0.25]) == {"al_pos_0": 0.5, "al_pos_1": 0.25}
    assert is_eval_key("eval_acc_0") and is_eval_key("acceptance_length") and not is_eval_key("loss")
    assert is_measured_al_key("al_pos_3") and not is_measured_al_key("tau_sim")


def test_atomic_writes_use_peagle_fileio() -> None:
    # a temporary name renamed over the destination: only peagle/fileio.py does that
    assert _where(r"os\.replace\(|tmp\.replace\(|tmp\.rename\(|\.tmp[\"']\)\.replace") == ["peagle/fileio.py"]


def test_celery_delivery_is_configured_in_one_place() -> None:
    assert _where(r"acks_late|prefetch|max_tasks_per_child|reject_on_worker_lost") == ["service/queue.py"]


def test_every_phase_the_trainer_announces_is_listed() -> None:
    announced = set()
    for name, text in _sources().items():
        if name.startswith("peagle/"):
            announced |= set(re.findall(r"_phase\(\s*sink,\s*[\"'](\w+)[\"']", text))
            announced |= set(re.findall(r"\bphase=[\"'](\w+)[\"']", text))
    assert announced and announced <= set(PHASES), announced - set(PHASES)


def test_training_only_file_names_are_spelled_once() -> None:
    # the checkpoint writer, the API's download and the client name them through peagle.spec.files
    assert _where(r"[\"']training_state\.pt[\"']") == ["peagle/spec/files.py"]
    assert _where(r"TRAINING_ONLY_FILES\s*=") == ["peagle/spec/files.py"]
