"""A hub-shaped `target.model` is a hub id, never a folder of the working directory; `target.revision` is a
branch, tag or commit name, never a path.

Before: `peagle/spec` or `etc/ssl` loaded (or named, in the error) a folder relative to the worker's working
directory, telling a tenant which exist; `target.revision: ../../../../etc` reached the hub cache, which
reads `refs/<revision>`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from peagle.builtin import resolve_target
from peagle.errors import TargetLoadError
from peagle.spec import SpecInvalidError, parse_spec
from peagle.spec.targets import is_hub_id, portable_verifier

BASE = {"target": {"model": "org/model"}}


def problems(**target: object) -> dict[str, str]:
    try:
        parse_spec({"target": {**BASE["target"], **target}})
    except SpecInvalidError as exc:
        return {p.path: p.message for p in exc.problems}
    return {}


@pytest.mark.parametrize("revision", ["../../../../etc", "/etc/passwd", "main/../../x", "a\\b", "..", ".hidden",
                                      "main/", "refs//x", "-rf", "x" * 129])
def test_an_unsafe_revision_is_refused_at_its_field(revision: str) -> None:
    assert "target.revision" in problems(revision=revision)


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "0123456789abcdef0123456789abcdef01234567",
                                      "release_2024-01"])
def test_branch_tag_and_commit_names_pass(revision: str) -> None:
    assert problems(revision=revision) == {}


def test_hub_ids_are_name_or_org_name_and_nothing_path_like() -> None:
    for name in ("gpt2", "org/model", "HuggingFaceTB/SmolLM2-135M-Instruct", "peagle/spec", "etc/ssl"):
        assert is_hub_id(name), name
    for name in ("/etc/ssl", "./peagle/spec", "../x", "~/models/x", "a/b/c", "org/..", "..", "a\\b", "org/m."):
        assert not is_hub_id(name), name


@pytest.fixture
def workdir_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_target_path: Path) -> Path:
    """A working directory holding a loadable model folder at the hub-shaped relative path `org/model`;
    the hub cache is empty and offline."""
    import huggingface_hub.constants as hub

    shutil.copytree(tiny_target_path, tmp_path / "work" / "org" / "model")
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return tmp_path / "work"


def test_a_hub_shaped_name_never_resolves_to_a_folder_of_the_working_directory(workdir_with: Path) -> None:
    assert (workdir_with / "org" / "model" / "config.json").is_file()
    assert resolve_target("org/model") == "org/model"  # a hub id, as a string: never Path("org/model")
    assert resolve_target("./org/model") == workdir_with / "org" / "model"  # a folder, when written as one


def test_loading_a_hub_shaped_target_never_loads_the_local_folder(workdir_with: Path) -> None:
    from peagle.target.loader import load_target, locate_target

    spec = parse_spec(BASE)
    with pytest.raises(TargetLoadError) as shadowed:
        load_target(spec, __import__("torch").device("cpu"))  # the folder would load: it must not
    shutil.rmtree(workdir_with / "org")
    with pytest.raises(TargetLoadError) as absent:
        locate_target(spec)
    assert str(shadowed.value) == str(absent.value)  # the same answer whether or not the folder exists
    assert str(workdir_with) not in str(absent.value)


def test_a_hub_id_is_its_own_portable_verifier_name() -> None:
    assert portable_verifier("org/model") == "org/model"
    assert portable_verifier("/models/llama") is None
