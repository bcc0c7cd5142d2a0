"""`peagle train --init-from`: a warm start from a local run of the tiny preset (parent -> child)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.spec import SpecInvalidError, preset


def _peagle(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP spin-waits on a shared CPU
    return subprocess.run([sys.executable, "-m", "peagle", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env)  # fmt: skip


def _metrics(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    return {r["step"]: r["values"] for r in rows if r["type"] == "metric" and "loss" in r["values"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_path) -> tuple[Path, Path]:
    """(parent, child): `peagle train tiny`, then the same spec warm-started from the parent's run directory."""
    root = tmp_path_factory.mktemp("warm")
    parent, child = root / "parent", root / "child"
    proc = _peagle("train", "tiny", "--out", str(parent))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _peagle("train", "tiny", "--out", str(child), "--init-from", str(parent))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return parent, child


def _best(run: Path) -> Path:
    return run / "checkpoints" / json.loads((run / "checkpoints" / "state.json").read_text())["best"]


def test_the_child_starts_where_the_parent_ended(runs) -> None:
    parent, child = runs
    # same data, same seed, same batches: only the starting weights differ
    assert _metrics(child)[1]["loss"] < 0.75 * _metrics(parent)[1]["loss"]
    prov = json.loads((child / "provenance.json").read_text())["resolved"]["init_from"]
    assert prov["init_from"] == str(parent) and Path(prov["export_dir"]) == _best(parent)
    assert prov["step"] == int(_best(parent).name.removeprefix("step_"))
    resolved = json.loads((child / "resolved_spec.json").read_text())
    assert resolved["draft"]["init_from"] == str(parent)
    assert resolved["draft"]["mask_token_id"] == prov["mask_token_id"]
    # the child's export carries the parent's vocabulary mapping
    from safetensors.torch import load_file

    mine, theirs = load_file(str(child / "export" / "model.safetensors")), load_file(str(_best(parent) / "model.safetensors"))
    assert torch.equal(mine["d2t"], theirs["d2t"])


def test_the_initial_weights_are_the_exports(runs, tiny_target_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from peagle.pipeline import build_initial_draft, warm_start

    parent, _ = runs
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_path), dtype=torch.float32)
    spec = preset("tiny").model_copy(deep=True)
    for folder in (parent / "export", _best(parent)):  # an export folder, or a checkpoint folder (it holds one)
        spec.draft.init_from = str(folder)
        warm = warm_start(spec, target.config.to_dict(), target.config.vocab_size)
        draft = build_initial_draft(spec, target, warm.vocab, warm.mask_token_id, [1, 2, 3],
                                    init_weights=warm.state)
        export = load_file(str(folder / "model.safetensors"))
        own = draft.state_dict()
        assert set(own) == set(export)
        for name, t in export.items():
            assert torch.equal(own[name], t.to(own[name].dtype)), (folder, name)
        assert draft.config.mask_token_id == warm.mask_token_id
    # from scratch (no init_weights) the same call gives other weights: the test would see a lost load
    fresh = build_initial_draft(spec, target, warm.vocab, warm.mask_token_id, [1, 2, 3]).state_dict()
    assert not torch.equal(fresh["fc.weight"], export["fc.weight"].to(torch.float32))


def test_a_source_that_does_not_fit_is_refused_naming_the_field(runs, tiny_target_path, tmp_path) -> None:
    from transformers import AutoConfig

    from peagle.pipeline import warm_start

    parent, _ = runs
    config = AutoConfig.from_pretrained(str(tiny_target_path)).to_dict()
    spec = preset("tiny").model_copy(deep=True)
    spec.draft.init_from, spec.draft.num_layers = str(parent), 2
    with pytest.raises(SpecInvalidError) as err:
        warm_start(spec, config, config["vocab_size"])
    assert [p.path for p in err.value.problems] == ["draft.init_from"]
    assert "draft.num_layers" in str(err.value)
    # through the CLI: the one error line and the spec_invalid exit code, before any training
    data = preset("tiny").model_dump(mode="json")
    data["draft"]["aux_layer_ids"] = [0, 1, 2]
    (tmp_path / "spec.json").write_text(json.dumps(data))
    proc = _peagle("train", str(tmp_path / "spec.json"), "--out", str(tmp_path / "run"), "--init-from", str(parent))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "draft.init_from" in proc.stderr and "aux layer ids [1, 2, 3]" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    proc = _peagle("train", "tiny", "--out", str(tmp_path / "r2"), "--init-from", str(tmp_path / "nothing"))
    assert proc.returncode != 0 and "draft.init_from" in proc.stderr


def test_a_resume_continues_from_the_runs_own_checkpoint(runs, tmp_path) -> None:
    _, child = runs
    again = tmp_path / "child"
    shutil.copytree(child, again)
    last = max(_metrics(child))
    shutil.rmtree(again / "checkpoints" / f"step_{last:06d}")  # the crash: the last checkpoint never landed
    shutil.rmtree(again / "export")
    kept = max(int(p.name.removeprefix("step_")) for p in (again / "checkpoints").glob("step_*"))
    gone = tmp_path / "parent-since-removed"  # the resume reads nothing of the parent
    proc = _peagle("train", "tiny", "--out", str(again), "--init-from", str(gone))
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = _metrics(again)
    # the steps after the kept checkpoint are the first run's own (from the parent they would start over)
    assert resumed[kept + 1]["loss"] == pytest.approx(_metrics(child)[kept + 1]["loss"], rel=1e-4)
    prov = json.loads((again / "provenance.json").read_text())["resolved"]["init_from"]
    assert prov["resumed"] and Path(prov["export_dir"]).name == f"step_{kept:06d}"
