"""Prompts read from a conversation dataset: each conversation up to its first answer, as a server is sent it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle.data.prompts import dataset_prompts, prompt_set_ids, tokenize_prompts
from peagle.errors import DataInvalidError


def test_sharegpt_array_keeps_the_system_turn_and_stops_at_the_answer(smollm2_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                           {"from": "gpt", "value": "SECRET ANSWER"}, {"from": "human", "value": "more"}]},
        {"conversations": [{"from": "human", "value": "Second?"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "Third?"}, {"from": "gpt", "value": "y"}]},
    ]))
    got = dataset_prompts(path, smollm2_tokenizer, 2)
    want = smollm2_tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi?"}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
    assert len(got) == 2 and got[0] == list(want)
    assert got[1] == tokenize_prompts(smollm2_tokenizer, ["Second?"])[0]
    assert "SECRET" not in smollm2_tokenizer.decode(got[0]) and "more" not in smollm2_tokenizer.decode(got[0])
    assert prompt_set_ids(str(path), 2, smollm2_tokenizer) == got  # a conversation file as a prompt set


def test_tokenised_rows_stop_before_the_first_supervised_token(smollm2_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tok.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) + "\n")
    assert dataset_prompts(path, smollm2_tokenizer, 4) == [[5, 6]]


def test_prompt_rows_and_errors(smollm2_tokenizer, tmp_path: Path) -> None:
    plain = tmp_path / "prompts.jsonl"
    plain.write_text(json.dumps({"prompt": "def f():"}) + "\n")  # a JSONL of prompts: read as before
    assert prompt_set_ids(str(plain), 1, smollm2_tokenizer) == tokenize_prompts(smollm2_tokenizer, ["def f():"])
    only_answers = tmp_path / "odd.jsonl"
    only_answers.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(DataInvalidError, match="no prompt in the dataset"):
        dataset_prompts(only_answers, smollm2_tokenizer, 1)
    with pytest.raises(DataInvalidError, match="no dataset root is configured"):
        prompt_set_ids("dataset:ds_x", 1, smollm2_tokenizer)
