"""The cross-field checks of a `TrainSpec`: rules that tie fields together, each problem at the field it
concerns (`SpecProblem`). The `TrainSpec` model validator runs them (`cross_field_problems`), so a spec
that exists is one that passed them; `peagle.spec.parse` unpacks them into `SpecInvalidError.problems`.

`resources.vllm.extra_args` is read here as `vllm serve`'s argparse would read it, and refused wherever
that reading could differ from ours: only flags of `VLLM_EXTRA_FLAGS`, each at most once; a value either
inline (`--flag=VALUE`, never empty) or as the next element (never one that starts with `-`); no
positional argument. An empty inline value once let the next element through as a "value" that vLLM then
read as an argument of its own (`["--quantization=", "--trust-remote-code"]`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import ValidationError

from peagle.spec.schema import HELDOUT_PROMPT_SET, VLLM_EXTRA_FLAGS, SpecProblem, TrainSpec
from peagle.spec.targets import NOT_FOR_VLLM, revision_problem

__all__ = ["cross_field_problems", "cross_field_problems_beside", "extra_args_problems"]

#: Rounds of `cross_field_problems_beside`: each drops the fields that failed (a dropped required field
#: fails as missing and drops its section next round).
_REPAIR_ROUNDS = 4

#: The value each kind of `VLLM_EXTRA_FLAGS` flag takes (a word starts with a letter or a digit).
_VALUE_PATTERNS = {
    "int": (re.compile(r"[0-9]{1,9}"), "an integer"),
    "float": (re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?"), "a number"),
    "word": (re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"), "a word"),
}


def cross_field_problems(spec: TrainSpec) -> list[SpecProblem]:
    """Every cross-field rule, each reported at the field it concerns."""
    out: list[SpecProblem] = []

    def bad(loc: tuple[str | int, ...], msg: str) -> None:
        out.append(SpecProblem(loc=loc, message=msg))

    if spec.target.revision is not None:
        why = revision_problem(spec.target.revision)
        if why is not None:
            bad(("target", "revision"), why)
    p = spec.peagle
    if p.down_sample_ratio_min > p.down_sample_ratio:
        bad(
            ("peagle", "down_sample_ratio_min"),
            f"must be <= peagle.down_sample_ratio ({p.down_sample_ratio}), got {p.down_sample_ratio_min}",
        )
    ids = spec.draft.aux_layer_ids
    if ids != "auto":
        if len(ids) != 3:
            bad(("draft", "aux_layer_ids"), f"must list exactly 3 layer ids (or be 'auto'), got {len(ids)}")
        if len(set(ids)) != len(ids):
            bad(("draft", "aux_layer_ids"), f"layer ids must be distinct, got {ids}")
        if any(i < 0 for i in ids):
            bad(("draft", "aux_layer_ids"), f"layer ids must be >= 0, got {ids}")
    if spec.draft.mask_token_id != "auto" and spec.draft.mask_token_id < 0:
        bad(("draft", "mask_token_id"), f"must be >= 0 or 'auto', got {spec.draft.mask_token_id}")
    o = spec.optim
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            bad(("optim", "betas", i), f"must be in [0, 1), got {b}")
    if spec.data.max_length > o.pack_length:
        bad(
            ("optim", "pack_length"),
            f"must be >= data.max_length ({spec.data.max_length}) so one conversation fits a row, "
            f"got {o.pack_length}",
        )
    k_eval = spec.eval.num_speculative_tokens
    if k_eval is not None and k_eval > p.num_depths:
        bad(
            ("eval", "num_speculative_tokens"),
            f"must be <= peagle.num_depths ({p.num_depths}): deeper positions are untrained, got {k_eval}",
        )
    if p.sequence_partitions > o.pack_length:
        bad(("peagle", "sequence_partitions"), f"must be <= optim.pack_length ({o.pack_length})")
    r = spec.resources
    if r.device == "cpu" and r.gpus > 0:
        bad(("resources", "gpus"), "must be 0 when resources.device is 'cpu'")
    if r.device == "cuda" and r.gpus == 0:
        bad(("resources", "gpus"), "must be >= 1 when resources.device is 'cuda'")
    if r.attention == "flex" and r.device == "cpu":
        bad(("resources", "attention"), "flex attention has no backward on CPU: use 'sdpa' or 'auto'")
    if r.precision == "bf16" and r.device == "cpu":
        bad(("resources", "precision"), "bf16 autocast is for CUDA; use 'fp32' or 'auto' on CPU")
    out.extend(_engine_problems(spec))
    if spec.checkpoints.select_best_by == "acceptance_length" and not spec.eval.prompt_sets:
        bad(
            ("checkpoints", "select_best_by"),
            "'acceptance_length' needs at least one eval.prompt_sets entry to measure it",
        )
    if spec.checkpoints.select_best_by == "tau_sim" and spec.data.eval_samples == 0:
        # tau_sim falls back to the training batch's running per-depth accuracy; allowed but noted.
        pass
    if spec.eval.al_every_steps is not None and not spec.eval.prompt_sets:
        bad(("eval", "al_every_steps"), "needs at least one eval.prompt_sets entry to measure AL on")
    names = [s.name for s in spec.eval.prompt_sets]
    if len(set(names)) != len(names):
        bad(("eval", "prompt_sets"), f"prompt set names must be distinct, got {names}")
    for i, name in enumerate(names):
        if name == HELDOUT_PROMPT_SET and spec.data.eval_samples == 0:
            bad(("eval", "prompt_sets", i, "name"),
                "'heldout' measures AL on the job's held-out conversations: set data.eval_samples >= 1")
    return out


def cross_field_problems_beside(data: dict[str, Any], failed: Sequence[tuple[str | int, ...]]
                                ) -> list[SpecProblem]:
    """The cross-field problems of `data`, a spec whose fields at `failed` (pydantic locs) failed their own
    validation, so that one answer lists every problem (the model validator runs only on valid fields).

    Each failed field is dropped (its default stands in, or its section's when it is required) until the
    rest validates; a cross-field problem at or naming a dropped field is left out: it would judge the
    default, not what was sent. [] when no such spec validates (a required section is missing).
    """
    data = copy.deepcopy(data)
    dropped: list[str] = []
    locs = list(failed)
    for _ in range(_REPAIR_ROUNDS):
        for loc in locs:
            path = _drop(data, loc)
            if path is None:
                return []
            dropped.append(path)
        try:
            TrainSpec.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            cross = [e for e in errors if e["type"] == "spec_cross_field"]
            locs = [tuple(e["loc"]) for e in errors if e["type"] != "spec_cross_field"]
            if not locs:
                found = [SpecProblem(loc=(*e["loc"], *p["loc"]), message=p["message"])
                         for e in cross for p in e.get("ctx", {}).get("problems", [])]
                return [p for p in found if not _touches(p, dropped)]
            continue
        return []
    return []


def _drop(data: dict[str, Any], loc: tuple[str | int, ...]) -> str | None:
    """Delete from `data` the deepest mapping key on `loc`; its dotted path (None when `loc` names none)."""
    node: Any = data
    keys: list[tuple[dict[str, Any], str, str]] = []  # (mapping, key, dotted path)
    walked: list[str] = []
    for key in loc:
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            walked.append(key)
            keys.append((node, key, ".".join(walked)))
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            walked.append(str(key))
            node = node[key]
        else:
            break
    if not keys:
        return None
    mapping, key, path = keys[-1]
    del mapping[key]
    return path


def _touches(problem: SpecProblem, dropped: Sequence[str]) -> bool:
    """Whether `problem` is at, under, above or names a dropped field (dotted paths)."""
    at = problem.path
    return any(at == d or at.startswith(f"{d}.") or d.startswith(f"{at}.") or d in problem.message
               for d in dropped)


def _engine_problems(spec: TrainSpec) -> list[SpecProblem]:
    """Rules of the target engine and its placement (`resources.target_engine`, `resources.vllm`, GPUs)."""
    out: list[SpecProblem] = []
    r, v = spec.resources, spec.resources.vllm

    def bad(loc: tuple[str | int, ...], msg: str) -> None:
        out.append(SpecProblem(loc=loc, message=msg))

    out.extend(SpecProblem(loc=("resources", "vllm", "extra_args", i), message=msg)
               for i, msg in extra_args_problems(v.extra_args))
    if r.target_engine == "vllm" and spec.target.model in NOT_FOR_VLLM:
        bad(("resources", "target_engine"), f"'vllm' cannot run {spec.target.model}: {NOT_FOR_VLLM[spec.target.model]}")
    if r.target_engine == "vllm" and spec.eval.engine == "reference":
        bad(("eval", "engine"), "'reference' runs the target in the trainer process, which resources.target_engine "
                                "'vllm' never does: use 'vllm' or 'auto' (AL measured by vLLM itself)")
    if r.target_engine == "hf" and spec.data.regenerate.engine == "vllm":
        bad(("data", "regenerate", "engine"), "'vllm' needs resources.target_engine 'vllm' or 'auto'")
    out.extend(_split_problems(spec))
    if r.gpus == 0:
        for name in ("capture_gpus", "train_gpus"):
            if getattr(r, name):
                bad(("resources", name), "must be 0 or unset when resources.gpus is 0 (CPU job)")
        if v.tensor_parallel_size > 1 or v.data_parallel_size > 1:
            bad(("resources", "vllm", "tensor_parallel_size" if v.tensor_parallel_size > 1 else "data_parallel_size"),
                "must be 1 on a CPU job (resources.gpus 0)")
        return out
    cap, tr = r.capture_gpus, r.train_gpus
    if cap is not None and tr is not None and cap + tr != r.gpus:
        bad(("resources", "train_gpus"),
            f"resources.capture_gpus ({cap}) + resources.train_gpus ({tr}) must equal resources.gpus ({r.gpus})")
    if cap is not None and cap > r.gpus:
        bad(("resources", "capture_gpus"), f"must be <= resources.gpus ({r.gpus}), got {cap}")
    if tr is not None and tr > r.gpus:
        bad(("resources", "train_gpus"), f"must be <= resources.gpus ({r.gpus}), got {tr}")
    if tr == 0 and (cap is None or cap == r.gpus) and r.gpus > 0:
        bad(("resources", "train_gpus"), "the trainer needs at least one GPU")
    engine_gpus = v.tensor_parallel_size * v.data_parallel_size
    if cap is not None and cap > 0 and engine_gpus != cap:
        bad(("resources", "vllm", "tensor_parallel_size"),
            f"tensor_parallel_size x data_parallel_size ({engine_gpus}) must equal resources.capture_gpus ({cap})")
    if cap is None and engine_gpus > r.gpus:
        bad(("resources", "vllm", "tensor_parallel_size"),
            f"tensor_parallel_size x data_parallel_size ({engine_gpus}) must be <= resources.gpus ({r.gpus})")
    return out


def extra_args_problems(args: Sequence[str]) -> Iterator[tuple[int, str]]:
    """(index into `args`, why) of every problem of `resources.vllm.extra_args` (module docstring).

    >>> list(extra_args_problems(["--quantization=", "--trust-remote-code"]))[0]
    (0, '--quantization= has an empty value: write --quantization=VALUE or --quantization VALUE')
    """
    first_at: dict[str, int] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            yield i, (f"expected a flag (--name), got {arg!r}: a value follows the flag that takes it and "
                      "positional arguments are not allowed")
            i += 1
            continue
        flag, eq, inline = arg.partition("=")
        kind = VLLM_EXTRA_FLAGS.get(flag, "unknown")
        if kind == "unknown":
            yield i, f"{flag!r} is not an allowed vllm serve flag (allowed: {', '.join(sorted(VLLM_EXTRA_FLAGS))})"
            i += 1
            continue
        if flag in first_at:
            yield i, f"{flag} is given twice (first at extra_args[{first_at[flag]}])"
        first_at.setdefault(flag, i)
        if kind is None:
            if eq:
                yield i, f"{flag} is a switch and takes no value"
            i += 1
            continue
        if eq:
            if not inline:
                yield i, f"{flag}= has an empty value: write {flag}=VALUE or {flag} VALUE"
            elif not _value_ok(kind, inline):
                yield i, _value_problem(flag, kind, inline)
            i += 1
            continue
        if i + 1 >= len(args):
            yield i, f"{flag} needs a value"
            i += 1
        elif args[i + 1].startswith("-"):
            # argparse reads it as the next option, not as this flag's value: judge it as that
            yield i + 1, f"{flag} needs a value, got the flag-like {args[i + 1]!r}"
            i += 1
        else:
            if not _value_ok(kind, args[i + 1]):
                yield i + 1, _value_problem(flag, kind, args[i + 1])
            i += 2


def _value_ok(kind: str, value: str) -> bool:
    return _VALUE_PATTERNS[kind][0].fullmatch(value) is not None


def _value_problem(flag: str, kind: str, value: str) -> str:
    return f"{flag} takes {_VALUE_PATTERNS[kind][1]}, got {value!r}"


def _split_problems(spec: TrainSpec) -> list[SpecProblem]:
    """Rules of a job split over engine workers (`resources.engine`, `resources.trainer`)."""
    r, e, t = spec.resources, spec.resources.engine, spec.resources.trainer
    out: list[SpecProblem] = []
    if e is None:
        if t is not None:
            out.append(SpecProblem(loc=("resources", "trainer"), message="needs resources.engine (the trainer is "
                                   "placed apart only when the engine runs on engine workers)"))
        return out

    def bad(loc: tuple[str | int, ...], msg: str) -> None:
        out.append(SpecProblem(loc=loc, message=msg))

    if r.target_engine == "hf":
        bad(("resources", "engine"), "engine workers run the target in vLLM: needs resources.target_engine "
                                     "'vllm' or 'auto'")
    if spec.eval.engine == "reference":
        bad(("eval", "engine"), "'reference' runs the target in the trainer process; with resources.engine the "
                                "target runs on engine workers: use 'vllm' or 'auto'")
    if r.capture != "online":
        bad(("resources", "capture"), "must be 'online' with resources.engine (the engine workers stream "
                                      "micro-batches to the trainer within resources.feature_disk_gb)")
    if e.gpus > 0 and r.device == "cpu":
        bad(("resources", "engine", "gpus"), "must be 0 when resources.device is 'cpu'")
    if t is not None and t.gpus and r.device == "cpu":
        bad(("resources", "trainer", "gpus"), "must be 0 when resources.device is 'cpu'")
    if r.capture_gpus:
        bad(("resources", "capture_gpus"), "must be unset with resources.engine (use resources.engine.gpus)")
    v = r.vllm
    if v.data_parallel_size > 1:
        bad(("resources", "vllm", "data_parallel_size"), "must be 1 with resources.engine (use "
                                                         "resources.engine.replicas)")
    if v.tensor_parallel_size > 1 and v.tensor_parallel_size != max(e.gpus, 1):
        bad(("resources", "vllm", "tensor_parallel_size"),
            f"must equal resources.engine.gpus ({e.gpus}) or be 1 (the replica's GPUs set it)")
    return out
