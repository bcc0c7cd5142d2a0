"""Issue 18 item 2: AL per prompt set includes the job's own held-out conversations (`heldout`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from peagle.data.packing import document_prompts, pack_documents
from peagle.data.prompts import tokenize_prompts
from peagle.data.template import tokenize_many
from peagle.errors import DataInvalidError, SpecInvalidError
from peagle.progress import RecordingSink
from peagle.spec import BUILTIN_PROMPT_SETS, parse_spec, preset


def test_a_held_out_prompt_is_the_conversation_up_to_its_answer_as_a_server_is_sent_it(smollm2_tokenizer) -> None:
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
        [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "Seven."},
         {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Eleven."}],
    ]
    enc = tokenize_many(smollm2_tokenizer, convs, max_length=512, workers=1)
    rows = pack_documents([(e.input_ids, e.loss_mask) for e in enc], 1024, seed=0)
    got = sorted(document_prompts(rows), key=len)
    want = sorted(tokenize_prompts(smollm2_tokenizer, ["What is the capital of France?", "Name a prime number."]),
                  key=len)
    assert got == want  # the template, the user turn and the assistant header; not one answer token


def test_heldout_needs_held_out_conversations() -> None:
    assert "heldout" in BUILTIN_PROMPT_SETS  # the API accepts it like the other builtin sets
    data = preset("tiny").model_dump(mode="json")
    data["eval"]["prompt_sets"] = [{"name": "humaneval", "num_prompts": 2}, {"name": "heldout", "num_prompts": 4}]
    data["data"]["eval_samples"] = 0
    with pytest.raises(SpecInvalidError, match=r"eval\.prompt_sets\.1\.name: 'heldout' measures AL on "
                       r"the job's held-out conversations: set data\.eval_samples >= 1"):
        parse_spec(data)
    data["data"]["eval_samples"] = 4
    assert parse_spec(data).eval.prompt_sets[1].name == "heldout"


def test_a_job_measures_al_on_its_own_held_out_conversations(tmp_path: Path, tiny_target_path: Path) -> None:
    from peagle.cli.evaluate import run_eval
    from peagle.data.prompts import run_heldout_prompts
    from peagle.pipeline import run_pipeline

    data = preset("tiny").model_dump(mode="json")
    data["eval"]["prompt_sets"] = [{"name": "humaneval", "num_prompts": 1}, {"name": "heldout", "num_prompts": 3}]
    run, sink = tmp_path / "run", RecordingSink()
    run_pipeline(parse_spec(data), run, sink=sink)
    ev: dict[str, Any] = json.loads((run / "export" / "eval.json").read_text())
    held = ev["prompt_sets"]["heldout"]
    assert held["num_prompts"] == 3 and held["acceptance_length"] is not None
    assert ev["prompt_sets"]["humaneval"]["num_prompts"] == 1
    # the same prompts from `peagle eval RUN/export --prompts heldout`, with the same AL
    prompts = run_heldout_prompts(run / "export", 3)
    assert len(prompts) == 3 and all(p and isinstance(p[0], int) for p in prompts)
    again = run_eval(run / "export", prompts=["heldout"], num_prompts=3, max_new_tokens=8, engine="reference")
    assert again["acceptance_length"] == pytest.approx(held["acceptance_length"])
    with pytest.raises(DataInvalidError, match=r"no RUN/data/prepared\.pt beside it"):
        run_heldout_prompts(tmp_path, 3)
