"""`target.name_or_path` and the spec's queues are checked like every other field (issue 46, item 7).

Before: `target.name_or_path` took any string (`$(id)`, `/etc/passwd;rm -rf /`, a newline) into the export's
config and the serve command; `resources.trainer.queue` could name an engine queue (`engine-...`, where the
chunks of split jobs wait) or a name the broker keeps for itself (`celery`, kombu's `unacked`), and
`resources.engine.queue` a queue no engine worker consumes.
"""

from __future__ import annotations

import pytest

from peagle.spec import parse_spec, preset, preset_names
from peagle.spec.schema import ENGINE_QUEUE_PREFIX, queue_problem
from tests.unit.spec.spec_problems import problems

UNSAFE_NAMES = ["$(id)", "`id`", "a;b", "org/m && rm -rf /", "x\ny", "x\ty", "/etc/passwd;id", "/a b", "../x",
                "./models/x", "org/name/extra", "/models/../etc", "/models/./x", "//server/share", "~/models/x",
                "org/m.", "builtin:no-such", "C:\\models\\x", "-rf", "org/'m'", "org/m$HOME", "x" * 300]
SAFE_NAMES = ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "my-org/smol-finetune", "org/m_v1.5",
              "builtin:tiny-llama", "builtin:smollm2-135m-instruct", "/models/llama-3.1-8b",
              "/srv/hf/models--org--m/snapshots/0123abcd", "/data/m+x@v2=1"]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_an_unsafe_name_or_path_is_refused_at_its_field(name: str) -> None:
    got = problems(target={"model": "org/model", "name_or_path": name})
    assert "target.name_or_path" in got, got


@pytest.mark.parametrize("name", SAFE_NAMES)
def test_hub_ids_builtins_and_absolute_folders_pass(name: str) -> None:
    assert problems(target={"model": "org/model", "name_or_path": name}) == {}


def test_every_preset_stays_valid() -> None:
    for name in preset_names():
        parse_spec(preset(name).model_dump(mode="json"))


@pytest.mark.parametrize("queue", ["engine-cpu", "engine-", "celery", "unacked", "unacked_index", "node.dq2",
                                   "w1.celery.pidbox", "celeryev.x"])
def test_the_trainer_queue_is_not_an_engine_or_reserved_queue(queue: str) -> None:
    got = problems(resources={"trainer": {"queue": queue}})
    assert "resources.trainer.queue" in got, got
    assert queue_problem(queue) is not None


@pytest.mark.parametrize("queue", ["celery", "unacked", "cpu", "gpu-a100", "node.dq2"])
def test_the_engine_queue_is_an_engine_queue(queue: str) -> None:
    got = problems(resources={"engine": {"queue": queue}})
    assert "resources.engine.queue" in got, got
    assert queue_problem(queue, engine=True) is not None


def test_ordinary_queues_pass() -> None:
    assert problems(resources={"trainer": {"queue": "gpu-a100"}, "engine": {"queue": "engine-big"}}) == {}
    for q in ("cpu", "gpu", "q1", "a100", "default", "bench", "gpu.h100"):
        assert queue_problem(q) is None, q
    assert queue_problem("engine-cpu", engine=True) is None
    assert ENGINE_QUEUE_PREFIX == "engine-"


def test_the_engine_prefix_is_the_services() -> None:
    from service.queue import ENGINE_QUEUE_PREFIX as SERVICE_PREFIX
    from service.queue import engine_queue

    assert SERVICE_PREFIX == ENGINE_QUEUE_PREFIX
    assert queue_problem(engine_queue("cpu"), engine=True) is None
