"""`peagle validate --json --portable` (the upload path) on hostile configs: refused before anything is sized
from them, with the JSON path and the reason; never a traceback; never a host path an upload names
(issue 46 items 1, 6 and 7; docs/export.md 5.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from peagle.export.rules import validate_export_report
from tests.unit.export.validating import refused, validate_json, validate_measured


def _set(d: Path, path: str, value: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value
    (d / "config.json").write_text(json.dumps(cfg))


def _replace_in_config(d: Path, old: str, new: str) -> None:
    text = (d / "config.json").read_text()
    assert text.count(old) == 1, old
    (d / "config.json").write_text(text.replace(old, new))


def test_a_billion_layers_is_refused_by_name_in_bounded_memory(export_dir: Path) -> None:
    _set(export_dir, "transformer_layer_config.num_hidden_layers", 10**9)
    run = validate_measured(export_dir)
    assert not run["killed"], run  # before issue 46: a list of 10**9 ints (18 GB, then the OOM killer)
    assert run["rc"] == 8, run
    out = json.loads(run["stdout"].strip().splitlines()[-1])
    assert len(out["violations"]) == 1, out
    msg = out["violations"][0]
    assert "transformer_layer_config.num_hidden_layers" in msg and "<= 256" in msg, msg
    # python + torch + the validator take about 300 MB here; 1.5 GB leaves room for other builds of torch
    # and is far below what sizing anything from 10**9 layers would take
    assert run["peak_rss_mb"] < 1536, run


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (
            "transformer_layer_config.hidden_size",
            10**7,
            "transformer_layer_config.hidden_size: must be <= 65536",
        ),
        ("transformer_layer_config.intermediate_size", 10**9, "transformer_layer_config.intermediate_size"),
        (
            "transformer_layer_config.num_attention_heads",
            10**6,
            "transformer_layer_config.num_attention_heads",
        ),
        ("transformer_layer_config.num_key_value_heads", -4, "num_key_value_heads: must be >= 1"),
        ("transformer_layer_config.head_dim", 0, "transformer_layer_config.head_dim: must be >= 1"),
        (
            "transformer_layer_config.vocab_size",
            10**10,
            "transformer_layer_config.vocab_size: must be <= 1048576",
        ),
        ("transformer_layer_config.max_position_embeddings", 10**12, "max_position_embeddings: must be <="),
        ("transformer_layer_config.num_hidden_layers", -1, "num_hidden_layers: must be >= 1"),
        ("transformer_layer_config.num_hidden_layers", "2", "num_hidden_layers: must be an integer"),
        ("transformer_layer_config.num_hidden_layers", True, "num_hidden_layers: must be an integer"),
        ("transformer_layer_config.num_hidden_layers", 2.0, "num_hidden_layers: must be an integer"),
        ("transformer_layer_config.num_hidden_layers", [2], "num_hidden_layers: must be an integer"),
        ("transformer_layer_config.rms_norm_eps", -1.0, "transformer_layer_config.rms_norm_eps: must be > 0"),
        ("draft_vocab_size", 10**8, "draft_vocab_size: must be <= 1048576"),
        ("target_hidden_size", 10**9, "target_hidden_size: must be <= 65536"),
        ("mask_token_id", -1, "mask_token_id: must be >= 0"),
        ("eagle_aux_hidden_state_layer_ids", [2, 4, 10**9], "eagle_aux_hidden_state_layer_ids[2]: must be <"),
        (
            "eagle_aux_hidden_state_layer_ids",
            list(range(10**4)),
            "eagle_aux_hidden_state_layer_ids: must hold at",
        ),
        (
            "speculators_config.proposal_methods.0.speculative_tokens",
            10**6,
            "speculative_tokens: must be <= 64",
        ),
        (
            "speculators_config.proposal_methods",
            [{}] * 1000,
            "speculators_config.proposal_methods: must hold at",
        ),
    ],
)
def test_sizes_past_any_real_draft_are_refused_with_their_json_path(export_dir, path, value, needle) -> None:
    _set(export_dir, path, value)
    refused(export_dir, needle)


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN', "transformer_layer_config.rms_norm_eps: NaN is not"),
        (
            '"hidden_size": 64',
            '"hidden_size": Infinity',
            "transformer_layer_config.hidden_size: Infinity is not",
        ),
        (
            '"hidden_size": 64',
            '"hidden_size": -Infinity',
            "transformer_layer_config.hidden_size: -Infinity is",
        ),
        (
            '"hidden_size": 64',
            '"hidden_size": 1e999',
            "transformer_layer_config.hidden_size: 1e999 overflows",
        ),
        (
            '"hidden_size": 64',
            '"hidden_size": ' + "9" * 5000,
            "transformer_layer_config.hidden_size: an integer of 5000 digits",
        ),
        (
            '"draft_vocab_size": 128',
            '"draft_vocab_size": 128, "draft_vocab_size": 129',
            "draft_vocab_size: duplicate key",
        ),
        # no database stores these; the report would carry them into the API's
        (
            '"torch_dtype": "bfloat16"',
            '"torch_dtype": "\\ud800"',
            "torch_dtype: must not contain a lone surrogate",
        ),
        ('"torch_dtype": "bfloat16"', '"torch_\\u0000": 1', "torch_\\x00: the key must not contain a NUL"),
    ],
)
def test_values_json_does_not_allow_are_refused_with_their_json_path(export_dir, old, new, needle) -> None:
    (export_dir / "config.json").write_text(json.dumps(json.loads((export_dir / "config.json").read_text())))
    _replace_in_config(export_dir, old, new)
    refused(export_dir, needle)


def test_deep_json_is_refused_before_it_is_parsed(export_dir: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000  # json.loads recursed until a RecursionError: "internal error"
    _replace_in_config(export_dir, '"torch_dtype": "bfloat16"', f'"torch_dtype": {deep}')
    msg = refused(export_dir, "config.json")
    assert "nested deeper than 32 levels" in msg, msg
    # brackets inside strings do not count
    _replace_in_config(export_dir, deep, json.dumps("[" * 100_000))
    assert not [v for v in validate_json(export_dir, "--portable")["violations"] if "nested" in v]


def test_a_config_larger_than_any_real_one_is_refused_unread(export_dir: Path) -> None:
    _set(export_dir, "padding", "x" * (2 << 20))
    assert "over the limit of 1048576" in refused(export_dir, "config.json")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"[]",
        b"null",
        b'"a string"',
        b"\xff\xfe{}",
        b"{" * 50,
        b'{"a": 1}{',
        b"\x00" * 64,
        b'{"transformer_layer_config": 7, "speculators_config": [], "speculators_model_type": {}}',
        b'{"speculators_config": {"proposal_methods": [7, "x", null], "verifier": []}}',
        b'{"transformer_layer_config": {"hidden_size": {}}, "speculators_model_type": "peagle"}',
    ],
)
def test_malformed_configs_are_refused_with_a_reason_never_a_traceback(
    export_dir: Path, content: bytes
) -> None:
    (export_dir / "config.json").write_bytes(content)
    out = validate_json(export_dir, "--portable")
    assert out["ok"] is False and out["violations"], out
    assert all("config.json" in v for v in out["violations"]), out["violations"]


def test_portable_mode_never_reads_a_host_folder_the_upload_names(
    export_dir: Path, verifier_dir: Path, tmp_path: Path
) -> None:
    # verifier_dir holds an 8-layer config.json; aux id 8 is out of range for it
    _set(export_dir, "eagle_aux_hidden_state_layer_ids", [2, 4, 8])
    host = validate_json(export_dir, "--portable")
    _set(export_dir, "speculators_config.verifier.name_or_path", str(tmp_path / "no-such-folder"))
    nowhere = validate_json(export_dir, "--portable")
    assert host == nowhere  # the answer tells nothing about the host folder
    assert any("not checked against the verifier" in w for w in host["warnings"]), host
    assert not any(str(verifier_dir) in json.dumps(v) for v in host.values()), host
    # without --portable (a user's own machine) the verifier's folder is still read, as before
    _set(export_dir, "speculators_config.verifier.name_or_path", str(verifier_dir))
    assert any("out of range for a 8-layer target" in v for v in validate_export_report(export_dir).errors)


def test_portable_mode_does_not_follow_links_out_of_the_export(export_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text((export_dir / "config.json").read_text())
    (export_dir / "config.json").unlink()
    (export_dir / "config.json").symlink_to(outside)
    assert "is a link" in refused(export_dir, "config.json")
    assert validate_export_report(export_dir).errors == []  # a user's own export may link its files
