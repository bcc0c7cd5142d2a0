"""Ingestion: formats, detection, roles, bad files and rows (never a crash, never a silent drop)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peagle.data.formats import (
    IngestReport,
    Limits,
    detect_format,
    iter_rows,
    normalise_role,
    validate_dataset,
)
from peagle.errors import DataInvalidError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def test_roles():
    assert normalise_role("human") == ("user", True)
    for r in ("gpt", "assistant", "ChatGPT", "bard"):
        assert normalise_role(r) == ("assistant", True)
    assert normalise_role("system") == ("system", True)
    assert normalise_role("weird") == ("assistant", False)


def test_real_sharegpt_streams_first_rows(sharegpt_rows):
    assert len(sharegpt_rows) == 40
    for msgs in sharegpt_rows:
        assert msgs[0]["role"] in ("user", "system")
        assert any(m["role"] == "assistant" for m in msgs)
        assert {m["role"] for m in msgs} <= {"user", "assistant", "system", "tool"}


def test_sharegpt_array_and_jsonl_agree(tmp_path):
    rows = [GOOD, {"conversations": [{"from": "human", "value": "a"}, {"from": "chatgpt", "value": "b"}]}]
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps(rows, indent=2))
    jl = write_jsonl(tmp_path / "a.jsonl", rows)
    assert detect_format(arr) == ("array", "sharegpt")
    assert detect_format(jl) == ("jsonl", "sharegpt")
    a = [r.messages for r in iter_rows(arr)]
    b = [r.messages for r in iter_rows(jl)]
    assert a == b and a[1][1] == {"role": "assistant", "content": "b"}


def test_array_parser_small_chunks(tmp_path):
    from peagle.data.formats import _iter_json_array

    rows = [
        {"conversations": [{"from": "human", "value": "x" * i}, {"from": "gpt", "value": "é✓" * i}]}
        for i in range(30)
    ]
    p = tmp_path / "a.json"
    p.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    got = [v for _, _, v in _iter_json_array(p, IngestReport(), Limits(), chunk_size=7)]
    assert got == rows


def test_messages_and_tokenized(tmp_path):
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
                ]
            }
        ],
    )
    assert [r.messages for r in iter_rows(m)] == [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ]
    t = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            {"input_ids": [5, 6], "loss_mask": [0]},
            {"input_ids": [5, "x"], "loss_mask": [0, 1]},
        ],
    )
    rep = IngestReport()
    got = list(iter_rows(t, "auto", rep))
    assert [(r.input_ids, r.loss_mask) for r in got] == [([5, 6, 7], [0, 1, 1])]
    assert rep.rows_read == 3 and rep.rows_kept == 1
    assert rep.skipped_by_reason == {"length_mismatch": 1, "wrong_type": 1}
    assert [b["line"] for b in rep.bad_rows] == [2, 3]


def test_bad_rows_are_reported_with_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(GOOD),
        json.dumps({"conversations": []}),  # empty conversation
        json.dumps({"conversations": "nope"}),  # wrong type
        json.dumps({"conversations": [{"from": "human", "value": 3}]}),  # wrong type in a turn
        '{"conversations": [',  # broken line
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps([1, 2]),
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "alien", "value": "a"}]}),
    ]
    raw = (
        "\n".join(lines) + "\n"
    ).encode() + b'{"conversations": [{"from": "human", "value": "\xff\xfe"}]}\n'
    p.write_bytes(raw)
    rep = IngestReport()
    kept = list(iter_rows(p, "sharegpt", rep))
    assert [r.line for r in kept] == [1, 8]
    assert rep.unknown_roles == {"alien": 1}
    assert rep.rows_read == 9 and rep.rows_kept == 2 and rep.rows_skipped == 7
    assert rep.skipped_by_reason == {
        "empty_conversation": 1,
        "wrong_type": 3,
        "invalid_json": 1,
        "no_assistant_turn": 1,
        "invalid_utf8": 1,
    }
    assert {b["line"]: b["reason"] for b in rep.bad_rows}[9] == "invalid_utf8"


def test_invalid_utf8_inside_array_skips_row(tmp_path):
    p = tmp_path / "a.json"
    body = (
        json.dumps([GOOD]).encode()[:-1]
        + b', {"conversations": [{"from": "human", "value": "\xc3\x28"}, {"from": "gpt", "value": "x"}]}]'
    )
    p.write_bytes(body)
    rep = IngestReport()
    assert len(list(iter_rows(p, "auto", rep))) == 1
    assert rep.skipped_by_reason == {"invalid_utf8": 1}


@pytest.mark.parametrize(
    "content, msg",
    [
        ('[\n {"conversations": [{"from": "human", "value": "hi"}', "line 2: truncated JSON"),
        ("[\n" + json.dumps(GOOD) + ",\n", "truncated JSON"),
        ("[\n" + json.dumps(GOOD) + " x", "line 2: expected ','"),
        ('[\n {"conversations": [}\n]', "malformed JSON"),
        ("hello", "line 1: not JSON"),
        ("", "empty file"),
    ],
)
def test_unusable_files_raise_naming_the_line(tmp_path, content, msg):
    p = tmp_path / "x.json"
    p.write_text(content)
    with pytest.raises(DataInvalidError, match=msg):
        list(iter_rows(p))


def test_limits_and_skip_and_max(tmp_path):
    rows = [GOOD] * 5 + [
        {"conversations": [{"from": "human", "value": "z" * 500}, {"from": "gpt", "value": "a"}]}
    ]
    p = write_jsonl(tmp_path / "x.jsonl", rows)
    rep = IngestReport()
    got = list(iter_rows(p, "auto", rep, limits=Limits(max_row_bytes=200)))
    assert len(got) == 5 and rep.skipped_by_reason == {"row_too_large": 1}
    assert [r.index for r in iter_rows(p, skip=2, max_samples=2)] == [2, 3]
    with pytest.raises(DataInvalidError, match="exceeds"):
        list(iter_rows(p, limits=Limits(max_file_bytes=10)))


def test_validate_dataset_report(tmp_path, smollm2_path):
    p = write_jsonl(tmp_path / "x.jsonl", [GOOD, {"conversations": []}])
    rep = validate_dataset(p, tokenizer_path=str(smollm2_path))
    assert rep["ok"] and rep["rows_read"] == 2 and rep["rows_kept"] == 1
    assert rep["bad_rows"] == [
        {"line": 2, "index": 1, "reason": "empty_conversation", "detail": "'conversations' is empty"}
    ]
    assert rep["tokens"] > rep["assistant_tokens"] == 2  # "hello" + <|im_end|>
    bad = tmp_path / "t.json"
    bad.write_text('[{"conversations": [')
    rep = validate_dataset(bad)
    assert not rep["ok"] and "truncated" in rep["error"]


def test_validate_cli_is_torch_free(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [GOOD])
    code = (
        f"import sys, runpy; sys.argv=['x', {str(p)!r}]; "
        "import peagle.data.formats as f; rc = f._main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows_kept"] == 1


def test_an_over_long_last_line_without_a_newline_is_counted_not_lost(tmp_path):
    """The last line of a file, over the row limit and with no newline after it, was silently dropped (not
    read, not counted, not refused): a dataset with a hidden over-long row read as `ok`."""
    big = {"conversations": [{"from": "human", "value": "z" * 500}, {"from": "gpt", "value": "a"}]}
    p = tmp_path / "x.jsonl"
    p.write_bytes(b"\n".join(json.dumps(r).encode() for r in [GOOD, GOOD, big]))  # no final newline
    rep = IngestReport()
    assert len(list(iter_rows(p, "auto", rep, limits=Limits(max_row_bytes=200)))) == 2
    assert rep.skipped_by_reason == {"row_too_large": 1} and rep.bad_rows[0]["line"] == 3
    report = validate_dataset(p, max_row_bytes=200)
    assert report["ok"] is False and "line 3" in report["error"], report
