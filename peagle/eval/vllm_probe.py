"""vLLM probe: runs INSIDE the vLLM venv (`.vllm-venv/bin/python peagle/eval/vllm_probe.py --plan P --out O`).

It imports only the standard library, vLLM and what vLLM itself ships (torch, safetensors); never
`peagle` (the project venv and vLLM's pin different transformers). `peagle.eval.serve_check` writes the
plan (prompts as token ids, already chat-templated, so both decoders see identical inputs), starts this
script as a subprocess and reads the JSON it writes. The probe reports raw facts only (per-request
acceptance histograms, seconds, token counts); every number derived from them (AL, speedup) is computed
on the project side (`peagle.eval.acceptance`, `peagle.eval.speedup`), once.

What it does:
1. `LLM(model=<export dir>)`: vLLM reads the speculators config, takes the verifier from it and (for
   `speculators_model_type: "peagle"`) turns on parallel drafting with K = `speculative_tokens` (or the
   plan's `num_speculative_tokens`). Per-request spec-decode metrics are on
   (`per_request_spec_decode_metrics="summary"`: each finished request carries its acceptance histogram).
2. Verifies parallel drafting is really on: the engine's speculative config has `method == "eagle3"` and
   `parallel_drafting is True`, and the drafter's `mask_hidden` buffer equals the exported tensor (not the
   plain-EAGLE fallback, which skips `mask_hidden`).
3. `al`: generates greedily from every prompt set (one batch per set) and returns each request's
   histogram, plus vLLM's global counters over the same generation (`llm.get_metrics()`), which the
   project side checks against the per-request sums.
4. `speedup`: the verifier alone (`LLM(model=<verifier>)`, no speculative config) against the verifier
   with the draft, same prompts, greedy, same `max_tokens`, for every K of `ks` and every batch size
   (batch b = the requests in groups of b, one `generate` call per group; the prompts are cycled so that
   every group is full). Both engines generate each group back to back, the order alternating from group
   to group and from round to round, so load from elsewhere on the machine hits both sides alike; every
   engine runs one short warm-up pass per batch size after it is loaded. `engines`: `both` keeps the two engines
   loaded in this process (measured: two SmolLM2-135M CPU engines, 2 GiB KV cache each, 5.8 GB RSS),
   `alternate` loads one at a time (a reload at every switch), `auto` keeps both when the memory left
   after the first engine holds a second one. Prefix caching is off, so every pass prefills its prompts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="JSON plan written by peagle.eval.serve_check.run_probe")
    p.add_argument("--out", required=True, help="where to write the JSON result")
    return p.parse_args(argv)


def _mask_hidden_of(worker: Any) -> Any:
    """Runs in the engine's worker: the drafter's `mask_hidden` buffer (or None when absent)."""
    runner = getattr(worker, "model_runner", worker)
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    buf = getattr(model, "mask_hidden", None)
    if buf is None:
        return None
    return buf.detach().float().cpu().flatten().tolist()


def _spec_counters(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}
    for m in metrics:
        name = m.name.removeprefix("vllm:")
        if name == "spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            acc = out["per_pos"]
            out["per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals, strict=False)]
        elif name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            out[name.removeprefix("spec_decode_")] += int(m.value)
    return out


def _counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    pos_b = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    return {
        **{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        "per_pos": [a - b for a, b in zip(after["per_pos"], pos_b, strict=False)],
    }


def _hardware(device: str) -> dict[str, Any]:
    """What the numbers were measured on (they only hold there)."""
    import torch

    cpu = platform.processor() or platform.machine()
    mem_gb = None
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        cpu = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), cpu)
        meminfo = Path("/proc/meminfo").read_text(encoding="utf-8")
        kb = next(int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemTotal"))
        mem_gb = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "device": device, "cpu": cpu, "cpu_count": usable, "memory_gb": mem_gb,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if device == "cuda" else 0,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }  # fmt: skip


def _mem_available_gb() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text(encoding="utf-8")
        return next(int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("MemAvailable")) / 2**20
    except (OSError, StopIteration, ValueError):
        return None


def _rss_gb() -> float | None:
    try:
        text = Path("/proc/self/status").read_text(encoding="utf-8")
        return next(int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration, ValueError):
        return None


class _Engines:
    """Creates the engines of a plan: the draft engine at a K, or the verifier alone."""

    def __init__(self, plan: dict[str, Any], device: str) -> None:
        self.plan, self.device = plan, device
        self.gpu_util = 0.4 if plan.get("speedup") else 0.5

    def make(self, k: int | None, *, spec: bool) -> Any:
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": self.plan["model"] if spec else self.plan["verifier"],
            "dtype": "bfloat16", "enforce_eager": True, "max_model_len": int(self.plan["max_model_len"]),
            "seed": 0, "disable_log_stats": False, "enable_prefix_caching": False,
        }  # fmt: skip
        if spec:
            kwargs["per_request_spec_decode_metrics"] = "summary"
            if k is not None:
                kwargs["speculative_config"] = {"num_speculative_tokens": int(k)}
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.gpu_util
        return LLM(**kwargs)

    def check(self, llm: Any) -> dict[str, Any]:
        """Parallel drafting really on (step 2 of the module docstring)."""
        import torch
        from safetensors.torch import load_file

        sc = llm.llm_engine.vllm_config.speculative_config
        dmc = getattr(sc, "draft_model_config", None)
        spec = {
            "method": getattr(sc, "method", None),
            "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)),
            "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
            "draft_model": getattr(dmc, "model", None),
            "draft_architectures": list(getattr(getattr(dmc, "hf_config", None), "architectures", None) or []),
        }
        problems = []
        if spec["method"] != "eagle3":
            problems.append(f"speculative method is {spec['method']!r}, expected 'eagle3'")
        if not spec["parallel_drafting"]:
            problems.append("parallel_drafting is off: the draft would run as plain sequential EAGLE-3")
        mask_loaded: bool | None = None
        try:
            got = llm.collective_rpc(_mask_hidden_of)[0]
        except Exception as exc:  # noqa: BLE001 - introspection is best effort across vLLM versions
            got = None
            problems.append(f"could not inspect the drafter's mask_hidden: {type(exc).__name__}: {exc}")
        if got is not None:
            want = load_file(str(Path(self.plan["model"]) / "model.safetensors"))["mask_hidden"].float().flatten()
            have = torch.tensor(got)
            mask_loaded = bool(have.shape == want.shape and torch.allclose(have, want, atol=1e-2, rtol=1e-2))
            if not mask_loaded:
                problems.append("the drafter's mask_hidden differs from the exported tensor")
        elif not problems:
            mask_loaded = False
            problems.append("the drafter has no mask_hidden buffer (plain-EAGLE fallback)")
        return {"speculative_config": spec, "mask_hidden_loaded": mask_loaded, "problems": problems}


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False))


def _request(r: Any) -> dict[str, Any]:
    out = r.outputs[0]
    m = getattr(out, "spec_decode_metrics", None)
    return {
        "tokens": len(out.token_ids),
        "histogram": list(m.histogram) if m is not None else None,
        "num_draft_tokens": int(m.num_draft_tokens) if m is not None else None,
    }


def _batches(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    """The requests of one pass at batch size b, in groups of b (prompts cycled to fill every group)."""
    n = len(prompts)
    total = -(-n // b) * b
    reqs = [prompts[i % n] for i in range(total)]
    return [reqs[i : i + b] for i in range(0, total, b)]


def _timed_pass(llm: Any, prompts: list[list[int]], b: int, max_tokens: int) -> dict[str, Any]:
    """One side over every group of a batch size (the warm-up, and the alternate-engines mode)."""
    acc = _Timed()
    for group in _batches(prompts, b):
        acc.add(llm, group, max_tokens)
    return acc.result()


class _Timed:
    """Seconds, tokens and per-request results of one side's generate calls, added up."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.results: list[Any] = []

    def add(self, llm: Any, group: list[list[int]], max_tokens: int) -> None:
        t0 = time.perf_counter()
        res = _generate(llm, group, max_tokens)
        self.seconds += time.perf_counter() - t0
        self.results.extend(res)

    def result(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "tokens": sum(len(r.outputs[0].token_ids) for r in self.results),
            "requests": [_request(r) for r in self.results],
            "outputs": [list(r.outputs[0].token_ids) for r in self.results],
        }


def _interleaved(load: Any, k: int, prompts: list[list[int]], b: int, max_tokens: int, r: int, *,
                 whole_pass: bool) -> dict[str, dict[str, Any]]:
    """Both sides of round r at batch size b. Each group of b requests is generated by both engines back to
    back, the order alternating from group to group and round to round (base, spec / spec, base), so a
    burst of load from elsewhere on the machine hits both sides alike. `whole_pass` (one engine loaded at
    a time): each side runs all groups, the order alternating by round only."""
    order = ("base", "spec") if r % 2 == 0 else ("spec", "base")
    timed = {"base": _Timed(), "spec": _Timed()}
    groups = _batches(prompts, b)
    if whole_pass:
        for side in order:
            llm = load(side, k)
            for group in groups:
                timed[side].add(llm, group, max_tokens)
    else:
        for i, group in enumerate(groups):
            for side in order if i % 2 == 0 else order[::-1]:
                timed[side].add(load(side, k), group, max_tokens)
    return {side: t.result() for side, t in timed.items()}


def _run_al(llm: Any, al: dict[str, Any]) -> list[dict[str, Any]]:
    sets = []
    for s in al["sets"]:
        before = _spec_counters(llm.get_metrics())
        t0 = time.perf_counter()
        res = _generate(llm, s["prompts"], int(al["max_new_tokens"]))
        seconds = time.perf_counter() - t0
        sets.append({
            "name": s["name"], "seconds": round(seconds, 3), "requests": [_request(r) for r in res],
            "outputs": [list(r.outputs[0].token_ids) for r in res],
            "counters": _counter_delta(_spec_counters(llm.get_metrics()), before),
        })  # fmt: skip
    return sets


def _engine_mode(engines: _Engines, mode: str, footprint_gb: float) -> tuple[str, str]:
    """`both` or `alternate` for `mode` (auto: both when a second engine fits beside the loaded one)."""
    if mode != "auto":
        return mode, f"engines: {mode} (asked)"
    if engines.device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        fits = free >= (engines.gpu_util + 0.05) * total
        return ("both" if fits else "alternate"), f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB GPU memory free"
    avail = _mem_available_gb()
    if avail is None:
        return "alternate", "memory available unknown"
    fits = avail >= 1.5 * max(footprint_gb, 1.0) + 1.0
    return ("both" if fits else "alternate"), (
        f"the draft engine took {footprint_gb:.1f} GB RSS, {avail:.1f} GB available beside it")


def _run_speedup(engines: _Engines, sp: dict[str, Any], state: dict[str, Any], footprint_gb: float) -> dict[str, Any]:
    """Step 4 of the module docstring; `state["main"]` (the draft engine at `state["main_k"]`) is reused
    for that K (and dropped when it is no longer needed)."""
    prompts, max_tokens = sp["prompts"], int(sp["max_new_tokens"])
    sizes, rounds = [int(b) for b in sp["batch_sizes"]], int(sp["rounds"])
    main_k = state.get("main_k")
    ks = sorted({int(k) for k in sp["ks"]}, key=lambda k: (k != main_k, k))  # the loaded engine's K first
    mode, reason = _engine_mode(engines, str(sp.get("engines", "auto")), footprint_gb)
    out: dict[str, Any] = {"engines": mode, "engines_reason": reason, "passes": [], "checks": {},
                           "outputs_identical": {}, "load_seconds": {}}
    loaded: dict[str, Any] = {}
    if mode == "alternate" or main_k not in ks:
        state.pop("main", None)
        gc.collect()

    def load(side: str, k: int) -> Any:
        if side in loaded:
            return loaded[side]
        if mode == "alternate":
            loaded.clear()
            gc.collect()
        t0 = time.perf_counter()
        reuse = side == "spec" and k == main_k and "main" in state
        llm = state.pop("main") if reuse else engines.make(k if side == "spec" else None, spec=side == "spec")
        name = f"spec_k{k}" if side == "spec" else "base"
        out["load_seconds"].setdefault(name, []).append(0.0 if reuse else round(time.perf_counter() - t0, 2))
        if side == "spec" and str(k) not in out["checks"]:
            out["checks"][str(k)] = engines.check(llm)
        for b in sizes:  # warm-up: kernels of every batch shape, not timed
            _timed_pass(llm, prompts[:b], b, min(8, max_tokens))
        loaded[side] = llm
        return llm

    for k in ks:
        if "spec" in loaded:  # the previous K's draft engine
            del loaded["spec"]
            gc.collect()
            # An in-process engine's shutdown destroys vLLM's global parallel groups, which the engine still
            # loaded also uses; creating the next engine first sets them up again.
            load("spec", k)
        first: dict[tuple[str, int], list[list[int]]] = {}
        for r in range(rounds):
            for b in sizes:
                timed = _interleaved(load, k, prompts, b, max_tokens, r, whole_pass=mode == "alternate")
                for side, p in timed.items():
                    if r == 0:
                        first[(side, b)] = p["outputs"]
                    out["passes"].append({"k": k, "batch_size": b, "round": r, "side": side,
                                          "seconds": round(p["seconds"], 4), "tokens": p["tokens"],
                                          "requests": p["requests"] if side == "spec" else []})
        out["outputs_identical"][str(k)] = {
            str(b): [x == y for x, y in zip(first[("base", b)], first[("spec", b)], strict=False)].count(True)
            for b in sizes}
    loaded.clear()
    gc.collect()
    return out


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    # In-process engines: the probe inspects the drafter module directly (mask_hidden really loaded), and a
    # second engine (the verifier alone) can live beside the first.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    from vllm import __version__ as vllm_version

    plan = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    device = plan.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = _Engines(plan, device)
    result: dict[str, Any] = {"engine": "vllm", "vllm_version": vllm_version, "device": device,
                              "hardware": _hardware(device)}
    k = plan.get("num_speculative_tokens")
    rss0 = _rss_gb() or 0.0
    t0 = time.perf_counter()
    state: dict[str, Any] = {"main": engines.make(k, spec=True)}
    result["load_seconds"] = round(time.perf_counter() - t0, 2)
    footprint = (_rss_gb() or 0.0) - rss0
    check = engines.check(state["main"])
    result.update(check)
    result["parallel_drafting_ok"] = not check["problems"]
    state["main_k"] = check["speculative_config"]["num_speculative_tokens"]
    if plan.get("al"):
        result["al"] = {"max_new_tokens": plan["al"]["max_new_tokens"], "sets": _run_al(state["main"], plan["al"])}
    if plan.get("speedup"):
        result["speedup"] = _run_speedup(engines, plan["speedup"], state, footprint)
    result["hardware"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return 0 if not check["problems"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
