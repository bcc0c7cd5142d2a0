"""`draft.init_from`: the shapes it takes, and the source checks that name the field that disagrees."""

from __future__ import annotations

import pytest

from peagle.spec import SpecInvalidError, parse_spec
from peagle.spec.init_from import InitFrom, init_from_problems, parse_init_from

MIN = {"target": {"model": "builtin:tiny-llama"}}


def _spec(**draft):
    return parse_spec({**MIN, "draft": draft})


def test_the_values_it_takes() -> None:
    assert parse_init_from("job:job_01ABC") == InitFrom("job", "job_01ABC", None)
    assert parse_init_from("job:job_01ABC@step_40") == InitFrom("job", "job_01ABC", 40)
    assert parse_init_from("draft:drf_01XYZ") == InitFrom("draft", "drf_01XYZ")
    assert parse_init_from("runs/parent/export") == InitFrom("path", "runs/parent/export")
    assert InitFrom("job", "job_1", 40).parent == {"job": "job_1", "step": 40}
    assert InitFrom("draft", "drf_1").parent == {"draft": "drf_1"}
    assert _spec(init_from="job:job_1@step_4").draft.init_from == "job:job_1@step_4"
    assert _spec().draft.init_from is None


@pytest.mark.parametrize("value", ["job:", "job:a/b", "job:x@step_", "job:x@4", "draft:", "draft:../x", "builtin:x"])
def test_malformed_values_name_the_field(value: str) -> None:
    with pytest.raises(SpecInvalidError) as err:
        _spec(init_from=value)
    assert [p.path for p in err.value.problems] == ["draft.init_from"]


def _export_config(*, hidden=64, vocab=1000, layers=1, aux=(1, 2, 3), vd=512, mask=3) -> dict:
    return {"draft_vocab_size": vd, "mask_token_id": mask, "eagle_aux_hidden_state_layer_ids": list(aux),
            "transformer_layer_config": {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers}}


TARGET = {"hidden_size": 64, "vocab_size": 1000, "num_hidden_layers": 4}  # auto aux ids: [1, 2, 3]


def test_a_source_that_fits_has_no_problem() -> None:
    assert init_from_problems(_export_config(), _spec(), TARGET, source="job j's draft") == []
    # the vocabulary and mask token come from the source when left unset / auto; K is free
    spec = parse_spec({**MIN, "draft": {"draft_vocab_size": 512, "mask_token_id": 3}, "peagle": {"num_depths": 7}})
    assert init_from_problems(_export_config(), spec, TARGET, source="s") == []
    # without the target's config only what the spec says is checked
    assert init_from_problems(_export_config(hidden=576), _spec(), None, source="s") == []


def test_each_mismatch_is_named_with_both_values() -> None:
    def one(cfg: dict, spec=None) -> str:
        problems = init_from_problems(cfg, spec or _spec(), TARGET, source="job j's draft")
        assert len(problems) == 1, problems
        return problems[0]

    assert one(_export_config(hidden=576)) == "hidden size 576 of job j's draft differs from the target's 64"
    assert "vocabulary of 32000 tokens" in one(_export_config(vocab=32000))
    assert "draft.num_layers" in one(_export_config(layers=2)) and "2 decoder layers" in one(_export_config(layers=2))
    msg = one(_export_config(aux=(0, 2, 3)))
    assert "[0, 2, 3]" in msg and "[1, 2, 3]" in msg and "draft.aux_layer_ids" in msg
    assert "draft.aux_layer_ids" in one(_export_config(), _spec(aux_layer_ids=[0, 1, 2]))
    msg = one(_export_config(), _spec(draft_vocab_size=256))
    assert "draft.draft_vocab_size 256" in msg and "512" in msg
    assert "draft.mask_token_id 5" in one(_export_config(), _spec(mask_token_id=5))
    assert init_from_problems({"transformer_layer_config": {}}, _spec(), TARGET, source="s")[0].endswith(
        "(not a P-EAGLE export)")
