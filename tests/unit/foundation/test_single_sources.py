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


#: The run folder's layout (docs/service.md 7) and what a second copy of each would look like in code.
#: `peagle/run_folder.py` spells them all; every reader (the trainer's checkpoints, the evaluation end, the
#: API's checkpoint routes, the warm start, promotion, the worker) calls it.
RUN_FOLDER = "peagle/run_folder.py"
RUN_FOLDER_COPIES = {
    "the job's folder under the artifact root (job_dir)": r"def \w*job_dir\(",
    "checkpoint folder names step_NNNNNN (step_dirname, step_of, checkpoint_relpath)":
        r"step_\{[^}]*06d\}|['\"]step_\*?['\"/]|['\"]checkpoints/",
    "the completeness marker (COMPLETE, is_complete, complete_checkpoints)": r"['\"/]COMPLETE['\"]",
    "the checkpoints and export subfolders, checkpoints/state.json (CHECKPOINTS, EXPORT, STATE_FILE)":
        r"/ ['\"](checkpoints|export|state\.json)['\"]",
    "archive names <job>-step_NNNNNN[.tar] and the archive cache (archive_folder, archive_file, archive_cache_file)":
        r"\}-step_|\}-\{step_dirname",
    "the inside-a-folder check (inside, resolve_inside)": r"\.is_relative_to\(",
    "the job:<id>@step_<N> form (job_ref, parse_job_ref)": r"@step_[{(]|['\"]@step_['\"]|f['\"]job:\{",
}
#: Where a pattern above matches something that is not the run folder: (fact, file) -> why.
NOT_THE_RUN_FOLDER = {
    ("the inside-a-folder check (inside, resolve_inside)", "api/access.py"):
        "model roots: strictly below a root, the root itself refused",
    ("the checkpoints and export subfolders, checkpoints/state.json (CHECKPOINTS, EXPORT, STATE_FILE)",
     "peagle/eval/live.py"): "an export into a temporary folder, not a run's",
}


def test_the_run_folder_layout_is_spelled_once() -> None:
    found = {what: [name for name in _where(rx) if name != RUN_FOLDER and (what, name) not in NOT_THE_RUN_FOLDER]
             for what, rx in RUN_FOLDER_COPIES.items()}
    assert found == {what: [] for what in RUN_FOLDER_COPIES}, "use peagle.run_folder instead"
    assert _where(r"artifact_root\(\) /") == [], "a job's folder is peagle.run_folder.job_dir(root, job_id)"
