"""`bench.bench_method`: a variant's run folder is its spec's hash, and a spec field added later keeps the
runs cached before it (at the value that reproduces them) under their old names."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import bench.bench_method as bench_method
from bench.bench_method import (
    ADDED_FIELDS,
    DEMO_640,
    OF_THE_DEMO,
    VARIANTS,
    data_dir,
    needs_baseline,
    spec_hash,
    train_peer,
    variant_spec,
)


def test_added_fields_at_their_old_value_keep_the_old_run_names() -> None:
    spec = variant_spec(VARIANTS["demo_640"][2])
    before = copy.deepcopy(spec)
    for (section, field), value in ADDED_FIELDS.items():
        assert spec[section][field] == value  # the 640-conversation demo runs at the value of the old runs
        del before[section][field]  # the spec as it was dumped before the field existed
    assert spec_hash(spec) == spec_hash(before)
    assert spec == variant_spec(VARIANTS["demo_640"][2])  # hashing does not change the spec it is given
    # a variant that moves an added field is a run of its own
    hashes = {spec_hash(variant_spec(VARIANTS[n][2])) for n in ("demo_640", "target_t0", "all_positions", "noise_01")}
    assert len(hashes) == 4


def test_the_variants_of_the_640_conversation_demo_keep_their_pairing() -> None:
    # the demo moved to 1280 conversations x 6 passes, then 1920 x 4 (docs/decisions.md decisions 18 and 19);
    # the variants measured against the 640-conversation demo are still one knob away from it
    for name, (_knob, _value, over) in VARIANTS.items():
        assert (set(DEMO_640) <= set(over)) == (name not in OF_THE_DEMO), name
    assert {k: VARIANTS["keep_r05"][2][k] for k in DEMO_640} == DEMO_640
    assert spec_hash(variant_spec(VARIANTS["demo_640"][2])) == spec_hash(variant_spec(VARIANTS["epochs_4"][2]))
    # the demo now trains every position (docs/decisions.md decision 20); the 1920 x 4 demo before it, the answers
    assert spec_hash(variant_spec(VARIANTS["demo_all_positions"][2])) == spec_hash(variant_spec({}))
    assert spec_hash(variant_spec(VARIANTS["data_3x_epochs_4"][2])) == "7ec4de73d795"
    assert spec_hash(variant_spec(VARIANTS["data_2x_epochs_6"][2])) == "ebcb4c8b85e1"  # the demo before, its run kept
    assert spec_hash(variant_spec(VARIANTS["decay_03"][2])) != spec_hash(variant_spec({"peagle.depth_decay": 0.3}))


def test_only_the_peer_waits_for_the_baseline() -> None:
    specs = {n: variant_spec(VARIANTS[n][2]) for n in VARIANTS if n != "peer"}
    assert needs_baseline(["peer"])
    assert needs_baseline(["keep_r05", "peer"])
    # every other variant prepares its data when there is none: the 640-conversation variants, other data
    # sizes, and variants on the preset's own data (the first writes DATA)
    assert not needs_baseline(["keep_r05", "demo_640"])
    assert not needs_baseline(["data_2x_epochs_6", "data_2x_epochs_4"])
    assert not needs_baseline(["data_3x_epochs_6", "demo_all_positions"])
    assert data_dir(specs["demo_all_positions"]) == data_dir(specs["baseline"])  # the preset's data, shared


def test_the_peer_trains_on_its_baseline_variants_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A defect found on 2026-11-27: the peer of a 640-conversation variant (`--peer-of all_positions`) linked
    the preset's data directory (1920 conversations, when it existed) instead of its baseline's."""
    spec = variant_spec(VARIANTS["all_positions"][2])
    assert data_dir(spec) != bench_method.DATA  # a 640-conversation variant has data of its own
    linked: list[Path] = []
    monkeypatch.setattr(bench_method, "ROOT", tmp_path)
    monkeypatch.setattr(bench_method, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(bench_method, "link_data", lambda run, data=bench_method.DATA: linked.append(data))
    monkeypatch.setattr(bench_method.subprocess, "run", lambda *a, **k: None)  # no peer venv needed

    def peer_of(name: str, variant: dict[str, Any]) -> Path:
        baseline = tmp_path / "runs" / name
        baseline.mkdir(parents=True)
        (baseline / "resolved_spec.json").write_text(json.dumps(variant))
        return train_peer(baseline, variant)

    run = peer_of("abc", spec)
    assert linked == [data_dir(spec)]
    assert run == tmp_path / "runs" / "peer-abc" and (run / "bench_train.json").exists()
    linked.clear()
    peer_of("def", variant_spec({}))
    assert linked == [bench_method.DATA]  # the preset's own variants share the preset's data
