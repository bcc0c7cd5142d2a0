"""How the target runs for one job: in the trainer process (transformers) or in a vLLM engine beside it.

    target = load_target_runtime(resolved, device)          # validating
    prepared = prepare_data(..., model=target.model, regen_engine=target.engine_config(resolved))
    with feature_sources(target, resolved, prepared, run, sink=sink) as (train_source, eval_source):
        Trainer(...).train()

`resources.target_engine` (resolved):

* ``hf``: the whole target is loaded here (`target.model`), features are captured in the loop (`online`)
  or cached to shards first (`offline`), as before;
* ``vllm``: the target is never loaded here. `target.parts` holds the embeddings, lm_head, final norm and
  the layers `draft.layer_init` copies (`peagle.target.parts`); a capture-mode `VllmServer` computes the
  features: `offline` writes every shard and stops the engine before training, `online` keeps it running
  ahead of the trainer (`peagle.target.streaming`) and stops it when training ends, however it ends.

Placement (`engine_devices`): the engine's GPUs come from `PEAGLE_ENGINE_DEVICES` (the supervisor splits the
job's GPUs, `peagle.engine.placement`), else from this process's visible GPUs by the same rule; on a CPU
job both share the cores. Under torchrun only rank 0 runs engines; the other ranks wait for its outputs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle.errors import EngineError, TargetLoadError
from peagle.progress import ProgressSink
from peagle.target.loader import TORCH_DTYPES, load_target, locate_target

__all__ = ["ENGINE_DONE", "TargetRuntime", "feature_sources", "load_target_runtime"]

#: Marker rank 0 writes into RUN/data once the engine phases (regeneration, capture) are done.
ENGINE_DONE = ".engine-done"


@dataclass
class TargetRuntime:
    """The loaded side of the target (module docstring)."""

    engine: str  # "hf" | "vllm"
    path: Path | str  # what transformers / vLLM load (a local folder or a hub id)
    tokenizer: Any
    model: Any | None  # the whole target (hf), else None
    parts: Any  # an object with the target's embeddings, lm_head, final norm (the model itself for hf)
    config: Any
    dtype: torch.dtype
    engine_devices: str | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.parts.get_input_embeddings().weight.shape[0])

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.config, "architectures", None) or [type(self.parts).__name__])

    def engine_config(self, resolved: Any, capture: Any = None) -> Any:
        """The `EngineConfig` of this target's vLLM engine (None when the target runs in transformers)."""
        if self.engine != "vllm":
            return None
        from peagle.engine.server import engine_config_from_spec

        return engine_config_from_spec(resolved, self.path, capture=capture, devices=self.engine_devices)


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _engine_devices(resolved: Any) -> str | None:
    """The engine's CUDA_VISIBLE_DEVICES (None on a CPU job)."""
    r = resolved.resources
    if r.device != "cuda" or r.gpus == 0:
        return None
    env = os.environ.get("PEAGLE_ENGINE_DEVICES")
    if env:
        return env
    from peagle.engine.placement import job_devices

    engine, _trainer = job_devices(r, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                   gpu_count=torch.cuda.device_count())
    return ",".join(engine)


def load_target_runtime(resolved: Any, device: torch.device) -> TargetRuntime:
    """Load the target as `resources.target_engine` says (the spec must be resolved).

    Raises:
        TargetLoadError: unknown builtin, missing folder, unreadable config or weights.
        EngineError: the engine is vllm but vLLM is not installed here.
    """
    from transformers import AutoTokenizer

    engine = resolved.resources.target_engine
    dtype = TORCH_DTYPES[resolved.target.dtype]
    if engine == "hf":
        model, tok, path = load_target(resolved, device)
        return TargetRuntime("hf", path, tok, model, model, model.config, dtype)
    from peagle.engine.locate import vllm_python

    if resolved.resources.engine is None and vllm_python() is None:
        raise EngineError(
            "resources.target_engine is 'vllm' but vLLM is not installed here: run `make vllm-env` (builds "
            ".vllm-venv, about 2 minutes) or set PEAGLE_VLLM_PYTHON, or use target_engine 'hf'"
        )
    path = locate_target(resolved)  # a hub id's snapshot: the engine is given its absolute folder
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.model {resolved.target.model!r} cannot be loaded: {first}") from None
    from peagle.target.parts import load_target_parts

    layers = range(-resolved.draft.num_layers, 0) if resolved.draft.layer_init == "target" else ()
    parts = load_target_parts(path, dtype=dtype, layers=list(layers))
    return TargetRuntime("vllm", path, tok, None, parts, parts.config, dtype, _engine_devices(resolved))


def wait_for_rank0(data_dir: Path, *, timeout_s: float = 7 * 24 * 3600.0) -> None:
    """Ranks > 0 of a vllm job: wait until rank 0 finished the engine phases (regeneration, capture)."""
    marker = data_dir / ENGINE_DONE
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            raise EngineError("rank 0 did not finish the engine phases in time")
        time.sleep(2.0)


@contextlib.contextmanager
def feature_sources(
    target: TargetRuntime, resolved: Any, prepared: Any, run: Path, *, vocab: Any, aux_ids: list[int], sink: ProgressSink,
    start_micro_batch: int = 0,
) -> Iterator[tuple[Any, Any]]:
    """(train source, eval source or None) for the trainer; the engine (if any) runs for as long as the
    sources need it and is stopped when the block exits (normally, by an error or by SIGTERM).
    `start_micro_batch`: where a split job's stream starts (a resumed run's checkpoint; the engine workers
    capture from there while the held-out chunks run, not from 0)."""
    from peagle.target.capture import TargetCapture
    from peagle.target.sources import (
        OfflineFeatureSource,
        OnlineFeatureSource,
        build_batch_source,
        write_feature_shards,
    )
    from peagle.train.optim import total_steps

    spec = resolved
    mbs, seed = spec.optim.micro_batch_size, spec.optim.seed
    selected = None if vocab.is_full else vocab.selected
    if target.engine == "hf":
        capture = TargetCapture(target.model, aux_ids, selected)
        source = build_batch_source(spec, capture, prepared.train, run, name="train", sink=sink)
        eval_source: Any = None
        if len(prepared.eval) and spec.resources.capture == "offline":
            eval_source = build_batch_source(spec, capture, prepared.eval, run, name="eval", sink=sink)
        elif len(prepared.eval):
            eval_source = OnlineFeatureSource(capture, prepared.eval, mbs, seed)
        yield source, eval_source
        return

    if spec.resources.engine is not None:
        yield _remote_sources(target, spec, prepared, run, aux_ids=aux_ids, selected=selected, sink=sink,
                              start=start_micro_batch)
        return

    from peagle.engine.server import CaptureOptions, VllmServer
    from peagle.target.streaming import StreamingFeatureSource
    from peagle.target.vllm_capture import VllmCapture

    feats = run / "data" / "features"
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    streaming = spec.resources.capture == "online" and not distributed
    if spec.resources.capture == "online" and distributed:
        sink.event("warning", message="online capture through vLLM runs with one trainer process; "
                                      "this torchrun job captures offline first")
    names = ["train"] + (["eval"] if len(prepared.eval) else [])
    done = all(_complete(feats / n) for n in names) if not streaming else False
    if not _is_main():
        wait_for_rank0(run / "data")
        done = True
    opts = CaptureOptions(layer_ids=(*aux_ids, target.num_layers), storage_dir=feats / ".engine")
    server = VllmServer(target.engine_config(resolved, capture=opts), log_path=run / "logs" / "engine-capture.log",
                        name="capture engine")
    with contextlib.ExitStack() as stack:
        if not done:
            shutil.rmtree(opts.storage_dir, ignore_errors=True)  # files a killed attempt's engine left unread
            sink.log("info", "starting the vLLM capture engine (the target runs there; the trainer holds the draft)")
            stack.enter_context(server)
            sink.log("info", f"capture engine ready in {server.started_s or 0:.0f} s")
            engine_capture = VllmCapture(server, target.parts, aux_ids, selected)
            aux_dtype = target.dtype  # the engine computed them in it: storing them so loses nothing
            t0 = time.monotonic()
            for n in names if not streaming else names[1:]:
                rows = prepared.train if n == "train" else prepared.eval
                write_feature_shards(engine_capture, rows, feats / n, aux_dtype=aux_dtype, sink=sink)
            if engine_capture.tokens_captured:
                dt = max(time.monotonic() - t0, 1e-9)
                sink.log("info", f"captured {engine_capture.documents_captured} documents, "
                                 f"{engine_capture.tokens_captured} tokens through vLLM "
                                 f"({engine_capture.tokens_captured / dt:.0f} tokens/s)")
        if _is_main():
            (run / "data" / ENGINE_DONE).write_text("ok\n")
        eval_source = OfflineFeatureSource(feats / "eval", mbs, seed) if len(prepared.eval) else None
        if not streaming:
            stack.close()  # the engine is not needed any more: its memory goes back to the trainer
            yield OfflineFeatureSource(feats / "train", mbs, seed), eval_source
            return
        steps = total_steps(spec.optim, -(-len(prepared.train) // mbs))
        stream = StreamingFeatureSource(
            engine_capture, prepared.train, mbs, seed, out_dir=feats / "stream",
            total_micro_batches=min(steps * spec.optim.grad_accumulation,
                                    spec.optim.epochs * -(-len(prepared.train) // mbs)),
            disk_budget_bytes=spec.resources.feature_disk_gb * 1e9,
        )  # fmt: skip
        stack.callback(stream.close)
        yield stream, eval_source


def _remote_sources(target: TargetRuntime, spec: Any, prepared: Any, run: Path, *, aux_ids: list[int], selected: Any,
                    sink: ProgressSink, start: int = 0) -> tuple[Any, Any]:
    """A split job's sources (`resources.engine`): the capture plan for the engine workers, the held-out
    shards they write, and the `RemoteFeatureSource` the trainer reads (`peagle.target.remote`)."""
    from peagle.split.protocol import capture_plan, eval_dir, remote_dir
    from peagle.target.remote import RemoteFeatureSource, wait_for_eval, write_plan
    from peagle.target.sources import OfflineFeatureSource
    from peagle.train.optim import total_steps

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise EngineError("resources.engine streams features to one trainer process: run its trainer on one GPU")
    mbs, seed = spec.optim.micro_batch_size, spec.optim.seed
    nb = -(-len(prepared.train) // mbs)
    total = min(total_steps(spec.optim, nb) * spec.optim.grad_accumulation, spec.optim.epochs * nb)
    replicas = spec.resources.engine.replicas
    chunk = max(1, min(32, total // (4 * replicas)))
    plan = capture_plan(num_rows=len(prepared.train), pack_length=int(prepared.train.input_ids.shape[1]),
                        hidden_size=int(target.config.hidden_size), micro_batch_size=mbs, seed=seed,
                        total_micro_batches=total, aux_layer_ids=list(aux_ids), chunk_micro_batches=chunk)
    plan["spec"] = spec.model_dump(mode="json")
    plan["selected"] = None if selected is None else [int(i) for i in selected.tolist()]
    d = remote_dir(run)
    write_plan(d, plan, prepared.train, prepared.eval if len(prepared.eval) else None)
    sink.log("info", f"capture on engine workers: {total} micro-batches in {len(plan['chunks'])} chunks, at most "
                     f"{replicas} at once")
    head = target.parts.get_output_embeddings()
    weight, bias = head.weight.detach(), getattr(head, "bias", None)
    bias = None if bias is None else bias.detach()
    if selected is not None:
        weight = weight.index_select(0, selected.long()).contiguous()
        bias = None if bias is None else bias.index_select(0, selected.long())
    source = RemoteFeatureSource(d, head_weight=weight, head_bias=bias,
                                 disk_budget_bytes=spec.resources.feature_disk_gb * 1e9)
    # capture chunks run while the held-out ones do, from where the trainer will read first (past the last
    # micro-batch: nothing to capture, the Trainer restarts the stream where it really reads)
    source.restart(min(max(start, 0), total))
    eval_source = None
    if len(prepared.eval):
        wait_for_eval(d)
        eval_source = OfflineFeatureSource(eval_dir(d), mbs, seed)
    (run / "data" / ENGINE_DONE).write_text("ok\n")
    return source, eval_source


def _complete(out: Path) -> bool:
    import json

    try:
        return bool(json.loads((out / "manifest.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False
