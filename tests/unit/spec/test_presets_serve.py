"""The demo preset is what a new user runs first: it must end with the vLLM serve check."""

from peagle.spec import preset


def test_demo_preset_runs_the_vllm_serve_check() -> None:
    # walk-through rough edge: the demo job finished with the "serve check" phase never run
    assert preset("demo").eval.serve_check is True
    assert preset("tiny").eval.serve_check is False  # the smoke preset stays seconds-long


def test_only_the_demo_decays_the_deeper_depths() -> None:
    # docs/decisions.md decision 15: measured on the demo; large runs keep the count-normalised loss
    assert preset("demo").peagle.depth_decay == 0.1
    assert preset("demo").peagle.loss_positions == "all"  # docs/decisions.md decision 20
    assert preset("gpu-llama3-8b").peagle.loss_positions == preset("tiny").peagle.loss_positions == "assistant"
    assert preset("gpu-llama3-8b").peagle.depth_decay == preset("gpu-qwen3-8b").peagle.depth_decay == 1.0
