"""Issue 38 item 6: the K schedule of the recommended `--speculative-config` (vLLM's
`num_speculative_tokens_per_batch_size`), built from the measured table: ranges from batch size 1, K 0 where
the draft is no gain, one K where it is (vLLM 0.32 serves a parallel-drafting draft at its K or at 0 only),
and the expansion vLLM's own scheduler makes of it."""

from __future__ import annotations

import itertools
import json
import subprocess
from typing import Any

import pytest

from peagle.eval.speedup import k_schedule, recommend, speculative_config


def _rows(table: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    """Measured rows from `{(K, batch size): speedup}`, the same speedup in each of 3 rounds."""
    return [{"num_speculative_tokens": k, "batch_size": b, "speedup": x, "speedup_per_round": [x] * 3}
            for (k, b), x in table.items()]


def _k_at(schedule: list[list[int]], b: int) -> int:
    """vLLM's reading of a schedule at batch size b: the range holding b, else the last range before it."""
    return next(k for first, _, k in reversed(schedule) if first <= b)


def test_the_worked_example_of_the_module_docstring() -> None:
    rows = _rows({(2, 1): 1.3, (3, 1): 1.2, (2, 4): 0.98, (3, 4): 1.05, (2, 8): 0.8, (3, 8): 0.7})
    rec = recommend(rows)
    assert [r["faster_ks"] for r in rec] == [[2, 3], [3], []]
    assert k_schedule(rec) == [[1, 3, 2], [4, 8, 0]]
    cfg = speculative_config("./draft", rec, 3)
    assert cfg == {"model": "./draft", "method": "eagle3", "num_speculative_tokens": 2, "parallel_drafting": True,
                   "num_speculative_tokens_per_batch_size": [[1, 3, 2], [4, 8, 0]]}


def test_each_measured_size_holds_up_to_the_next_and_equal_neighbours_merge() -> None:
    rows = _rows({(3, 1): 1.4, (3, 2): 1.2, (3, 4): 0.9, (3, 16): 1.1, (3, 64): 0.5})
    schedule = k_schedule(recommend(rows))
    assert schedule == [[1, 3, 3], [4, 15, 0], [16, 63, 3], [64, 64, 0]]
    # contiguous from 1, non-overlapping: what vLLM requires
    assert schedule[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in itertools.pairwise(schedule))
    assert [_k_at(schedule, b) for b in (1, 2, 3, 4, 15, 16, 63, 64, 500)] == [3, 3, 3, 0, 0, 3, 3, 0, 0]


def test_a_slowdown_everywhere_recommends_no_draft() -> None:
    rec = recommend(_rows({(1, 1): 0.9, (2, 1): 0.8, (1, 8): 0.5, (2, 8): 0.4}))
    assert [r["num_speculative_tokens"] for r in rec] == [0, 0]
    assert k_schedule(rec) == [] and speculative_config("./draft", rec, 2) is None


def test_a_gain_everywhere_at_one_k_is_the_plain_config() -> None:
    rec = recommend(_rows({(2, 1): 1.5, (2, 8): 1.1}))
    assert k_schedule(rec) == [[1, 8, 2]]
    assert speculative_config("./d", rec, 4) == {"model": "./d", "method": "eagle3", "num_speculative_tokens": 2,
                                                 "parallel_drafting": True}


def test_a_single_batch_size() -> None:
    assert k_schedule(recommend(_rows({(4, 1): 1.2}))) == [[1, 1, 4]]
    assert speculative_config("./d", recommend(_rows({(4, 1): 1.2})), 4)["num_speculative_tokens"] == 4
    assert speculative_config("./d", recommend(_rows({(4, 8): 0.7})), 4) is None
    # measured at batch 8 only: that K holds from batch 1 (nothing smaller was measured)
    assert k_schedule(recommend(_rows({(2, 8): 1.1}))) == [[1, 8, 2]]


def test_ties_take_the_smaller_k() -> None:
    rec = recommend(_rows({(2, 1): 1.2, (4, 1): 1.2, (2, 8): 1.1, (4, 8): 1.3}))
    assert [r["num_speculative_tokens"] for r in rec] == [2, 4]
    # one K for all (vLLM 0.32): K 2, recommended at batch 1, is a gain at batch 8 too
    assert k_schedule(rec) == [[1, 8, 2]]


def test_slower_at_batch_1_and_faster_later_turns_the_draft_on_later() -> None:
    rec = recommend(_rows({(3, 1): 0.95, (3, 4): 1.2}))
    assert k_schedule(rec) == [[1, 3, 0], [4, 4, 3]]
    cfg = speculative_config("./d", rec, 5)
    assert cfg is not None and cfg["num_speculative_tokens"] == 3  # the schedule's max: vLLM sizes buffers by it


def test_one_noisy_round_is_no_gain_so_k_0_there() -> None:
    rows = [{"num_speculative_tokens": 2, "batch_size": 1, "speedup": 1.2, "speedup_per_round": [1.2, 1.3, 1.1]},
            {"num_speculative_tokens": 2, "batch_size": 8, "speedup": 1.02, "speedup_per_round": [1.02, 0.97, 1.05]}]
    assert k_schedule(recommend(rows)) == [[1, 7, 2], [8, 8, 0]]


def test_a_report_stored_before_faster_ks_keeps_its_recommended_k_only() -> None:
    old = [{"batch_size": 1, "num_speculative_tokens": 3, "speedup": 1.2},
           {"batch_size": 4, "num_speculative_tokens": 2, "speedup": 1.1},  # K 3 not known to gain here: off
           {"batch_size": 8, "num_speculative_tokens": 0, "speedup": 0.8}]
    assert k_schedule(old) == [[1, 3, 3], [4, 8, 0]]
    assert speculative_config("./d", [], 3) == {"model": "./d", "method": "eagle3", "num_speculative_tokens": 3,
                                                "parallel_drafting": True}  # not measured: the trained K


#: vLLM's own validation and expansion of a schedule (what its scheduler runs on), printed as the K per batch
#: size 1..max_num_seqs; and whether `--speculative-config` takes the key (a field of SpeculativeConfig).
_VLLM_EXPANDS = """
import dataclasses, json, sys
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
cfg, max_num_seqs = json.loads(sys.argv[1]), int(sys.argv[2])
fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
unknown = sorted(set(cfg) - fields - {"model", "method"})
dense = build_dynamic_sd_schedule_lookup(cfg["num_speculative_tokens_per_batch_size"], max_num_seqs,
                                         cfg["num_speculative_tokens"])
print(json.dumps({"unknown": unknown, "k": dense[1:]}))
"""


@pytest.mark.slow
def test_vllm_reads_the_schedule_as_recommended() -> None:
    """vLLM 0.32's own code expands the schedule to the recommended K at every batch size (K 0 where the draft
    is a slowdown) and knows every key of the config."""
    from peagle.engine.locate import vllm_python

    py = vllm_python()
    if py is None:
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    rows = _rows({(2, 1): 1.3, (3, 1): 1.2, (2, 4): 1.1, (3, 4): 1.05, (2, 16): 0.8, (3, 16): 0.7})
    rec = recommend(rows)
    cfg = speculative_config("./draft", rec, 3)
    assert cfg is not None and cfg["num_speculative_tokens_per_batch_size"] == [[1, 15, 2], [16, 16, 0]]
    out = subprocess.run([str(py), "-c", _VLLM_EXPANDS, json.dumps(cfg), "32"], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["unknown"] == []
    assert got["k"] == [2] * 15 + [0] * 17  # batch 1..15 -> K 2; 16 and beyond (carried) -> no draft


def test_peagle_eval_prints_the_serve_command_with_the_schedule(tmp_path, capsys) -> None:
    """`peagle eval --speedup` ends its serving table with the command that serves the schedule."""
    import shlex

    from peagle.cli.run import _print_eval

    (tmp_path / "config.json").write_text(json.dumps(
        {"speculators_config": {"verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}}}))
    rows = _rows({(2, 1): 1.3, (3, 1): 1.2, (2, 8): 0.8, (3, 8): 0.7})
    serving = {"num_speculative_tokens": 3, "table": [], "recommended": recommend(rows), "hardware": {}}
    _print_eval({"serving": serving}, tmp_path)
    line = capsys.readouterr().out.splitlines()[-1]
    words = shlex.split(line.split("serve with: ", 1)[1])
    assert words[:3] == ["vllm", "serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert json.loads(words[4]) == {"model": str(tmp_path), "method": "eagle3", "num_speculative_tokens": 2,
                                    "parallel_drafting": True,
                                    "num_speculative_tokens_per_batch_size": [[1, 7, 2], [8, 8, 0]]}
