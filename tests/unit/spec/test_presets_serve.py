"""The demo preset is what a new user runs first: it must end with the vLLM serve check."""

from peagle.spec import preset


def test_demo_preset_runs_the_vllm_serve_check() -> None:
    # walk-through rough edge: the demo job finished with the "serve check" phase never run
    assert preset("demo").eval.serve_check is True
    assert preset("tiny").eval.serve_check is False  # the smoke preset stays seconds-long
