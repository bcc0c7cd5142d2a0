"""The target in an inference engine: vLLM beside a draft-only trainer (docs/engine.md).

- `locate`: where the vLLM interpreter is (torch-free; the API's dry run uses it too).
- `server`: start, health-check and always stop a `vllm serve` process (`VllmServer`), through `guard`.
- `guard`: a stdlib-only process that owns the engine's process group and kills it with its parent.
- `vllm_plugins/`: code vLLM loads through its own plug-in points (the CPU/CUDA hidden-states connector;
  `peagle_tree`, which ties every vLLM process to its parent, so an engine's tree dies with whichever of
  its processes dies first); it runs inside vLLM's venv and never imports `peagle`.
"""
