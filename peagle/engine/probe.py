"""vLLM probe: runs INSIDE the vLLM venv (`.vllm-venv/bin/python peagle/engine/probe.py --plan P --out O`).

It imports only the standard library, vLLM and what vLLM itself ships (torch, safetensors); never
`peagle` (the project venv and vLLM's pin different transformers). `peagle.engine.prober` writes the
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
   engine runs one short warm-up pass per batch size after it is loaded. `engines`: `both` keeps the two
   engines loaded side by side (two SmolLM2-135M CPU engines with a 2 GiB KV cache each: about 5.8 GB
   RSS), `alternate` loads one at a time (a reload at every switch), `auto` keeps both when the memory
   available holds two. Prefix caching is off, so every pass prefills its prompts.
   Each engine runs in a child process of its own (`--serve`, `_Remote`): two engines in one process
   share one OpenMP runtime and thread binding, and an A/A run there (the verifier against itself) came
   out at 0.49 at batch 8. `calibrate: true` in the plan makes such an A/A run: both sides the verifier
   alone, to see the method's own bias and noise on a machine.
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

#: Prefix of the progress lines the probe prints to its stdout (its log): `peagle eval` shows them as they come.
PROGRESS_PREFIX = "peagle-probe: "


def _say(message: str) -> None:
    """A progress line in the probe's log (what `peagle eval` forwards while the probe runs)."""
    print(PROGRESS_PREFIX + message, flush=True)  # noqa: T201 - the probe's stdout is its log file


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="JSON plan written by peagle.engine.prober.run_probe")
    p.add_argument("--out", help="where to write the JSON result")
    p.add_argument("--serve", choices=("base", "spec"), help="(internal) hold one engine, answer on --reply-fd")
    p.add_argument("--k", type=int, default=0, help="(internal, --serve spec) K of the draft engine")
    p.add_argument("--reply-fd", type=int, default=-1, help="(internal) file descriptor for the answers")
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

        if spec and self.plan.get("calibrate"):  # A/A: the "draft" side is the verifier alone too
            spec = False
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

        if self.plan.get("calibrate"):
            return {"speculative_config": None, "mask_hidden_loaded": None, "problems": [],
                    "calibration": "A/A: both sides are the verifier alone"}

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


class _Timed:
    """Seconds, tokens and per-request results of one side's generate calls, added up."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = 0.0
        self.requests: list[dict[str, Any]] = []
        self.outputs: list[list[int]] = []

    def add(self, answer: dict[str, Any]) -> None:
        self.seconds += float(answer["seconds"])
        self.cpu_seconds += float(answer.get("cpu_seconds") or 0.0)
        self.requests.extend(answer["requests"])
        self.outputs.extend(answer["outputs"])

    def result(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
                "tokens": sum(int(r["tokens"]) for r in self.requests), "requests": self.requests,
                "outputs": self.outputs}


#: Seconds between two timed calls: the engine that just finished lets its OpenMP threads stop spinning
#: (KMP_BLOCKTIME, 200 ms) before the other one starts, so neither side pays for the other.
SETTLE_S = 0.3


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
            engine = load(side, k)
            for group in groups:
                time.sleep(SETTLE_S)
                timed[side].add(engine.generate(group, max_tokens))
    else:
        for i, group in enumerate(groups):
            for side in order if i % 2 == 0 else order[::-1]:
                engine = load(side, k)
                time.sleep(SETTLE_S)
                timed[side].add(engine.generate(group, max_tokens))
    return {side: t.result() for side, t in timed.items()}


class _Remote:
    """One engine in a child process of its own (`--serve base|spec`): its own OpenMP runtime and thread
    binding, so the two engines of a speedup measurement never share them (measured: two engines in ONE
    process made the first one 2-3x slower at batch 8 than an identical second one, an A/A ratio of 0.49).
    `generate` sends a group of prompts on the child's stdin; the child times its own `llm.generate` and
    answers on a dedicated pipe (vLLM's logs go to the probe's log)."""

    def __init__(self, plan_file: str, side: str, k: int | None) -> None:
        import subprocess

        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--plan", plan_file, "--serve", side,
               "--k", str(k or 0), "--reply-fd", str(write_fd)]
        env = dict(os.environ)
        # The threads `vllm serve`'s worker computes with on a CPU: all usable CPUs but one, kept for its
        # scheduler process (an in-process engine would drop to one thread).
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable - 1)))
        env.setdefault("KMP_BLOCKTIME", "5")  # as vLLM sets it for its CPU workers (ms of spinning after work)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write_fd,), text=True, env=env)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r", encoding="utf-8")
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        line = self.replies.readline()
        if not line:
            code = self.proc.wait(timeout=60)
            raise RuntimeError(f"the engine process exited ({code}) before answering: see the log above")
        return dict(json.loads(line))

    def generate(self, group: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": group, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        import subprocess

        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.replies.close()


def _serve(args: argparse.Namespace, plan: dict[str, Any], engines: _Engines) -> int:
    """`--serve`: load one engine, say so (with the parallel-drafting check of a draft engine), then answer
    `generate` requests with the seconds of `llm.generate` and its per-request results until `quit`."""
    reply = os.fdopen(args.reply_fd, "w", encoding="utf-8")
    rss0 = _rss_gb() or 0.0
    t0 = time.perf_counter()
    llm = engines.make(args.k or None, spec=args.serve == "spec")
    ready: dict[str, Any] = {"load_seconds": round(time.perf_counter() - t0, 2), "footprint_gb": (_rss_gb() or 0.0) - rss0}
    if args.serve == "spec":
        ready["check"] = engines.check(llm)
    reply.write(json.dumps(ready) + "\n")
    reply.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") != "generate":
            break
        t1, c1 = time.perf_counter(), time.process_time()
        res = _generate(llm, cmd["prompts"], int(cmd["max_tokens"]))
        seconds, cpu_seconds = time.perf_counter() - t1, time.process_time() - c1
        reply.write(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "requests": [_request(r) for r in res],
                                "outputs": [list(r.outputs[0].token_ids) for r in res]}) + "\n")
        reply.flush()
    return 0


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
    """`both` or `alternate` for `mode` (auto: both when two engines fit side by side)."""
    if mode != "auto":
        return mode, f"engines: {mode} (asked)"
    if engines.device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        fits = free >= 2 * (engines.gpu_util + 0.05) * total
        return ("both" if fits else "alternate"), f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB GPU memory free"
    avail = _mem_available_gb()
    if avail is None:
        return "alternate", "memory available unknown"
    fits = avail >= 2 * 1.2 * max(footprint_gb, 1.0) + 1.0
    return ("both" if fits else "alternate"), (
        f"an engine takes {footprint_gb:.1f} GB RSS, {avail:.1f} GB available for two")


def _run_speedup(engines: _Engines, sp: dict[str, Any], plan_file: str, footprint_gb: float) -> dict[str, Any]:
    """Step 4 of the module docstring: the verifier alone and the draft engine at each K, each in a child
    process of its own (`_Remote`), loaded side by side (`both`) or one at a time (`alternate`)."""
    prompts, max_tokens = sp["prompts"], int(sp["max_new_tokens"])
    sizes, rounds = [int(b) for b in sp["batch_sizes"]], int(sp["rounds"])
    ks = sorted({int(k) for k in sp["ks"]})
    mode, reason = _engine_mode(engines, str(sp.get("engines", "auto")), footprint_gb)
    out: dict[str, Any] = {"engines": mode, "engines_reason": reason, "passes": [], "checks": {},
                           "outputs_identical": {}, "load_seconds": {}}
    loaded: dict[str, _Remote] = {}

    def drop(side: str) -> None:
        if side in loaded:
            loaded.pop(side).close()

    def load(side: str, k: int) -> _Remote:
        if side in loaded:
            return loaded[side]
        if mode == "alternate":
            for other in list(loaded):
                drop(other)
        engine = _Remote(plan_file, side, k if side == "spec" else None)
        out["load_seconds"].setdefault(f"spec_k{k}" if side == "spec" else "base", []).append(
            engine.ready["load_seconds"])
        if side == "spec" and str(k) not in out["checks"]:
            out["checks"][str(k)] = engine.ready["check"]
        for b in sizes:  # warm-up: kernels of every batch shape, not timed
            for group in _batches(prompts[:b], b):
                engine.generate(group, min(8, max_tokens))
        loaded[side] = engine
        return engine

    try:
        for i, k in enumerate(ks):
            drop("spec")  # the previous K's draft engine
            first: dict[tuple[str, int], list[list[int]]] = {}
            for r in range(rounds):
                for b in sizes:
                    _say(f"speedup K={k} ({i + 1}/{len(ks)}), round {r + 1}/{rounds}, batch size {b}")
                    timed = _interleaved(load, k, prompts, b, max_tokens, r, whole_pass=mode == "alternate")
                    for side, p in timed.items():
                        if r == 0:
                            first[(side, b)] = p["outputs"]
                        out["passes"].append({"k": k, "batch_size": b, "round": r, "side": side,
                                              "seconds": round(p["seconds"], 4),
                                              "cpu_seconds": round(p["cpu_seconds"], 4), "tokens": p["tokens"],
                                              "requests": p["requests"] if side == "spec" else []})
            out["outputs_identical"][str(k)] = {
                str(b): [x == y for x, y in zip(first[("base", b)], first[("spec", b)], strict=False)].count(True)
                for b in sizes}
    finally:
        for side in list(loaded):
            drop(side)
    return out


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    # In-process engine: the probe inspects the drafter module directly (mask_hidden really loaded).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch

    plan = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    device = plan.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = _Engines(plan, device)
    if args.serve:
        return _serve(args, plan, engines)
    from vllm import __version__ as vllm_version

    result: dict[str, Any] = {"engine": "vllm", "vllm_version": vllm_version, "device": device,
                              "hardware": _hardware(device)}
    rss0 = _rss_gb() or 0.0
    t0 = time.perf_counter()
    _say("loading the draft engine")
    llm = engines.make(plan.get("num_speculative_tokens"), spec=True)
    result["load_seconds"] = round(time.perf_counter() - t0, 2)
    footprint = (_rss_gb() or 0.0) - rss0
    check = engines.check(llm)
    result.update(check)
    result["parallel_drafting_ok"] = not check["problems"]
    if plan.get("al"):
        _say(f"engine loaded in {result['load_seconds']:.0f} s: acceptance length on {len(plan['al']['sets'])} "
             "prompt set(s)")
        result["al"] = {"max_new_tokens": plan["al"]["max_new_tokens"], "sets": _run_al(llm, plan["al"])}
    del llm  # the speedup's engines run in processes of their own
    gc.collect()
    if plan.get("speedup"):
        result["speedup"] = _run_speedup(engines, plan["speedup"], args.plan, footprint)
    result["hardware"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return 0 if not check["problems"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
