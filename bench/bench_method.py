"""Method against the peer, by measurement: paired variants of the demo draft on the same on-policy features
(issue 18, item 5).

Every variant is the 640-conversation demo of docs/decisions.md decision 16 (`demo_640`: target in vLLM,
regenerated answers, features captured by vLLM) with ONE knob changed (`VARIANTS`); `baseline` is the `demo`
preset as it is now (1920 conversations, 4 passes: docs/decisions.md decision 19; `data_2x_epochs_6` is the
1280-conversation demo of docs/decisions.md decision 18). Variants of one data size
train on the same prepared rows and the same feature shards (one
data directory, linked into each run, so `peagle train` reloads it and starts no engine), with the same
steps and seed, and are measured the same way: `peagle eval RUN/export --engine vllm` on the first 40
HumanEval prompts x 128 new tokens at K = 4 (AL pooled as vLLM counts it, per-position acceptance; the
same on 40 held-out ShareGPT first turns, the training data's own domain, as a second column). The
peer is speculators 0.9.0's own `PEagleDraftModel` + loss trained by `bench/peer_train_al.py` on the same
shards, optimizer, steps and seed.

Runs live in .peagle/bench/method/runs/<spec hash>/ (a variant whose spec equals another's shares its run;
a finished, measured run is never retrained; delete the folder to redo it); the data directory is
.peagle/bench/method/data (prepared by the first run when missing: regeneration and capture in vLLM). A
variant that changes its prepared data (more conversations, the packing, the vocabulary) has its own,
.peagle/bench/method/data-<hash>, prepared by its first run the same way (answers already regenerated come
from the regeneration cache); it is then paired on the seed and the conversations, not on the rows.
One training or one evaluation at a time.

    .venv/bin/python -m bench.bench_method [--variants baseline,peer] [--variants all] [--list]

Writes bench/results/method.json: per variant its knob and value, AL, per-position acceptance, held-out
tau_sim (as trained, and over the first 4 depths), training seconds, the load average while it ran, and the
AL ratio to the run it is paired with (`paired_with`: `demo_640`, or `baseline` for the peer); `ours_vs_peer` (goal >= 1.10) and `demo_al` (goal
AL >= 1.5 at K = 4). Every measured variant (of any earlier invocation) is in the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ROOT / ".peagle" / "bench" / "method"
DATA = BASE / "data"
RUNS = BASE / "runs"
RESULTS = ROOT / "bench" / "results"
PEER_PY = ROOT / ".peer-venv" / "bin" / "python"
#: What every variant is measured with (issue 18: "AL at least 1.5 at K=4 on HumanEval").
NUM_PROMPTS, MAX_NEW_TOKENS, SERVE_K = 40, 128, 4
TARGET_AL, TARGET_VS_PEER = 1.5, 1.10

#: The demo before it trained on 1280 conversations (docs/decisions.md decision 18): 640 conversations, 4 passes.
#: The variants measured against it (docs/decisions.md decisions 14, 15, 16, 17) carry it: they keep their
#: pairing and their runs.
DEMO_640: dict[str, Any] = {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 640}], "optim.epochs": 4,
                            "optim.max_steps": 960, "peagle.loss_positions": "assistant"}
#: Variants of the demo itself (paired with `baseline`, not with `demo_640`).
OF_THE_DEMO = ("baseline", "peer", "demo_all_positions")


def _640(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**DEMO_640, **overrides}


#: name -> (knob, value, overrides of the demo preset as dotted paths). `baseline` is the preset itself; every
#: other variant but the peer is one knob changed from `demo_640` (its overrides are applied over DEMO_640).
_VARIANTS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "baseline": ("demo preset", None, {}),
    "demo_640": ("the demo before: 640 conversations, 4 passes", 640, {}),
    "keep_r05": ("peagle.down_sample_ratio", 0.5, {"peagle.down_sample_ratio": 0.5}),
    "keep_r07": ("peagle.down_sample_ratio", 0.7, {"peagle.down_sample_ratio": 0.7}),
    "keep_r09": ("peagle.down_sample_ratio", 0.9, {"peagle.down_sample_ratio": 0.9}),
    "rmin_0": ("peagle.down_sample_ratio_min", 0.0, {"peagle.down_sample_ratio_min": 0.0}),
    "rmin_05": ("peagle.down_sample_ratio_min", 0.5, {"peagle.down_sample_ratio_min": 0.5}),
    "depths_6": ("peagle.num_depths (served 4)", 6, {"peagle.num_depths": 6}),
    "depths_8": ("peagle.num_depths (served 4)", 8, {"peagle.num_depths": 8}),
    "depths_4": ("peagle.num_depths", 4, {"peagle.num_depths": 4}),
    "depths_1": ("peagle.num_depths (served 4)", 1, {"peagle.num_depths": 1}),
    "depths_2": ("peagle.num_depths (served 4)", 2, {"peagle.num_depths": 2}),
    "decay_10": ("peagle.depth_decay", 1.0, {"peagle.depth_decay": 1.0}),
    "decay_08": ("peagle.depth_decay", 0.8, {"peagle.depth_decay": 0.8}),
    "decay_05": ("peagle.depth_decay", 0.5, {"peagle.depth_decay": 0.5}),
    "decay_03": ("peagle.depth_decay", 0.3, {"peagle.depth_decay": 0.3}),
    "decay_01": ("peagle.depth_decay", 0.1, {"peagle.depth_decay": 0.1}),
    "lr_5e-4": ("optim.lr", 5e-4, {"optim.lr": 5e-4}),
    "lr_1e-3": ("optim.lr", 1e-3, {"optim.lr": 1e-3}),
    "lr_2e-3": ("optim.lr", 2e-3, {"optim.lr": 2e-3}),
    "lr_3e-3": ("optim.lr", 3e-3, {"optim.lr": 3e-3}),
    "lr_5e-3": ("optim.lr", 5e-3, {"optim.lr": 5e-3}),
    "sched_const": ("optim.schedule", "constant", {"optim.schedule": "constant"}),
    "sched_linear": ("optim.schedule", "linear", {"optim.schedule": "linear"}),
    "minlr_0": ("optim.min_lr_ratio", 0.0, {"optim.min_lr_ratio": 0.0}),
    "anchors_256": ("peagle.max_anchors", 256, {"peagle.max_anchors": 256}),
    "anchors_128": ("peagle.max_anchors", 128, {"peagle.max_anchors": 128}),
    "layers_2": ("draft.num_layers", 2, {"draft.num_layers": 2}),
    "epochs_1": ("optim.epochs (the demo before: 240 steps)", 1, {"optim.epochs": 1, "optim.max_steps": 240}),
    "epochs_2": ("optim.epochs (2x steps)", 2, {"optim.epochs": 2, "optim.max_steps": 480}),
    "epochs_4": ("optim.epochs (4x steps)", 4, {"optim.epochs": 4, "optim.max_steps": 960}),
    "epochs_8": ("optim.epochs (8x steps)", 8, {"optim.epochs": 8, "optim.max_steps": 1920}),
    # depth_decay 0.1 leaves depths >= 2 about 0.5% of the loss but about a third of the COD elements a step
    # computes: 2 trained depths (served at 4) buy more passes in the same CPU time
    "d2_epochs_6": ("num_depths 2 (served 4), epochs 6: the baseline's compute", 6,
                    {"peagle.num_depths": 2, "optim.epochs": 6, "optim.max_steps": 1440}),
    "d2_epochs_8": ("num_depths 2 (served 4), epochs 8", 8,
                    {"peagle.num_depths": 2, "optim.epochs": 8, "optim.max_steps": 1920}),
    "wd_01": ("optim.weight_decay", 0.1, {"optim.weight_decay": 0.1}),
    "frozen_head": ("draft.freeze_lm_head", True, {"draft.freeze_lm_head": True}),
    "frozen_embed": ("draft.freeze_embeddings", True, {"draft.freeze_embeddings": True}),
    "data_2x": ("data.sources max_samples (1 epoch, 2x steps)", 1280,
                {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 1280}], "optim.epochs": 1,
                 "optim.max_steps": 480}),
    # the demo's 640 conversations hold only ~6.9k distinct answer tokens: 8192 covers 94% of the held-out
    # answer tokens and about 90% of HumanEval's; 16384 covers 97.7% and about 95%
    "vocab_16k": ("draft.draft_vocab_size", 16384, {"draft.draft_vocab_size": 16384}),
    "vocab_32k": ("draft.draft_vocab_size", 32768, {"draft.draft_vocab_size": 32768}),
    "data_2x_epochs_4": ("data.sources max_samples (4 epochs, 4x the 1-pass steps)", 1280,
                         {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 1280}], "optim.epochs": 4,
                          "optim.max_steps": 1920}),
    # greedy verification accepts the target's argmax: fit it alone (cross-entropy) or a sharpened target
    "target_t0": ("peagle.target_temperature (argmax CE)", 0.0, {"peagle.target_temperature": 0.0}),
    "target_t05": ("peagle.target_temperature", 0.5, {"peagle.target_temperature": 0.5}),
    "target_t2": ("peagle.target_temperature", 2.0, {"peagle.target_temperature": 2.0}),
    "data_2x_epochs_6": ("data.sources max_samples (6 epochs, 6x the 1-pass steps)", 1280,
                         {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 1280}], "optim.epochs": 6,
                          "optim.max_steps": 2880}),
    # 3x the data in the steps (the training time) of the 1280 x 6 demo: the demo of docs/decisions.md decision 19,
    # which trained the answers only (DEMO_640's loss_positions), before docs/decisions.md decision 20
    "data_3x_epochs_4": ("data.sources max_samples (4 epochs: the demo's steps)", 1920,
                         {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 1920}], "optim.epochs": 4,
                          "optim.max_steps": 2880}),
    "data_3x_epochs_6": ("data.sources max_samples (6 epochs)", 1920,
                         {"data.sources": [{"path": "builtin:sharegpt", "max_samples": 1920}], "optim.epochs": 6,
                          "optim.max_steps": 4320}),
    # the target's logits are captured at every position: train on the prompts' tokens too (held-out metrics
    # and AL still score the answers)
    "all_positions": ("peagle.loss_positions", "all", {"peagle.loss_positions": "all"}),
    # EAGLE's training noise on the target features, relative to each aux state's RMS, against memorising the
    # rows; SmolLM2's aux states have outlier channels (RMS about 3x the typical channel's magnitude), so a = 0.03
    # is about 10% of a typical channel (EAGLE's U(-0.1, 0.1) on features of about 1) and 0.1 about 30%
    "noise_003": ("peagle.feature_noise", 0.03, {"peagle.feature_noise": 0.03}),
    "noise_01": ("peagle.feature_noise", 0.1, {"peagle.feature_noise": 0.1}),
    # the three that did not lower AL, together (docs/decisions.md decision 20)
    "all_frozen_noise": ("all positions, frozen lm_head, noise 0.03", None,
                         {"peagle.loss_positions": "all", "draft.freeze_lm_head": True, "peagle.feature_noise": 0.03}),
    # a moving average of the weights (evaluated, exported) against memorising the rows, on the recipe of the
    # demo now (every position): paired with `all_positions`
    "all_ema_099": ("all positions, optim.ema_decay", 0.99, {"peagle.loss_positions": "all", "optim.ema_decay": 0.99}),
    "all_ema_0995": ("all positions, optim.ema_decay", 0.995,
                     {"peagle.loss_positions": "all", "optim.ema_decay": 0.995}),
    # logit matching beside the KL (the KL's high-temperature limit: the tail of the target's logits that the
    # KL at T = 1 barely weighs), against memorising the rows: paired with `all_positions`
    "all_logit_mse_1": ("all positions, peagle.logit_mse", 1.0, {"peagle.loss_positions": "all", "peagle.logit_mse": 1.0}),
    "all_logit_mse_5": ("all positions, peagle.logit_mse", 5.0, {"peagle.loss_positions": "all", "peagle.logit_mse": 5.0}),
    # capacity and step size at four passes on every position (2 layers and lr 3e-3 were measured at one pass
    # only: docs/decisions.md decision 14): paired with `all_positions`
    "all_layers_2": ("all positions, draft.num_layers", 2, {"peagle.loss_positions": "all", "draft.num_layers": 2}),
    "all_lr_2e-3": ("all positions, optim.lr", 2e-3, {"peagle.loss_positions": "all", "optim.lr": 2e-3}),
    # three layers: the last aux state is the input of the target's layer N - 3, so with `draft.layer_init`
    # target the draft's layers start as exactly the target layers that follow it (N - 3, N - 2, N - 1);
    # two layers start as N - 2, N - 1 and skip one. Paired with `all_positions` and `all_layers_2`
    "all_layers_3": ("all positions, draft.num_layers", 3, {"peagle.loss_positions": "all", "draft.num_layers": 3}),
    # masked (depth >= 1) slots start as the mean target feature, not N(0, 1) (docs/decisions.md decision 25):
    # paired with `all_layers_3` and its peer, and with `all_layers_2`
    "l3_mask_mean": ("3 layers, all positions, draft.mask_hidden_init", "feature_mean",
                     {"peagle.loss_positions": "all", "draft.num_layers": 3, "draft.mask_hidden_init": "feature_mean"}),
    "l2_mask_mean": ("2 layers, all positions, draft.mask_hidden_init", "feature_mean",
                     {"peagle.loss_positions": "all", "draft.num_layers": 2, "draft.mask_hidden_init": "feature_mean"}),
    # the copied decoder layers at a fraction of the learning rate, the fresh parts (fc, mask_hidden) and the
    # embedding / lm_head at the full one (docs/decisions.md decision 26): paired with `all_layers_2` and its peer
    "l2_layer_lr_01": ("2 layers, all positions, optim.layer_lr_scale", 0.1,
                       {"peagle.loss_positions": "all", "draft.num_layers": 2, "optim.layer_lr_scale": 0.1}),
    "l2_layer_lr_03": ("2 layers, all positions, optim.layer_lr_scale", 0.3,
                       {"peagle.loss_positions": "all", "draft.num_layers": 2, "optim.layer_lr_scale": 0.3}),
    "l2_layer_lr_3": ("2 layers, all positions, optim.layer_lr_scale", 3.0,
                      {"peagle.loss_positions": "all", "draft.num_layers": 2, "optim.layer_lr_scale": 3.0}),
    "l2_layer_lr_10": ("2 layers, all positions, optim.layer_lr_scale", 10.0,
                       {"peagle.loss_positions": "all", "draft.num_layers": 2, "optim.layer_lr_scale": 10.0}),
    # the demo (1920 conversations x 4 passes) with the prompts' tokens trained too: the demo now, the same run
    # as `baseline` (docs/decisions.md decision 20)
    "demo_all_positions": ("peagle.loss_positions (the demo)", "all", {"peagle.loss_positions": "all"}),
    "peer": ("speculators 0.9.0 PEagleDraftModel + loss (baseline spec)", None, {}),
}
VARIANTS = {name: (knob, value, over if name in OF_THE_DEMO else _640(over))
            for name, (knob, value, over) in _VARIANTS.items()}
DEFAULT_VARIANTS = "baseline,peer"


def variant_spec(overrides: dict[str, Any]) -> dict[str, Any]:
    """The demo preset with `overrides` (dotted paths), trained with the target in vLLM and no AL inside the
    run (it is measured afterwards, the same way for every variant). Validated."""
    from peagle.spec import parse_spec, preset

    spec = preset("demo").model_dump(mode="json")
    spec["resources"]["target_engine"] = "vllm"
    # the target in bfloat16 as every measured run had it (the preset now says `auto`: bf16 only where the CPU
    # runs it natively): the same features, and so the same run folders, on every machine
    spec["target"]["dtype"] = "bfloat16"
    spec["eval"].update(prompt_sets=[], serve_check=False, speedup=False, al_every_steps=None)
    spec["preview"]["conversations"] = 0  # a variant is measured after its run: no first curve needed
    for path, value in overrides.items():
        node = spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"{path}: no such spec field")
        node[leaf] = value
    return parse_spec(spec).model_dump(mode="json")


#: Spec fields added after runs were cached, with the value that reproduces the runs made before they
#: existed: left out of the hash at that value, so those runs stay found (and are not trained again).
ADDED_FIELDS: dict[tuple[str, str], Any] = {("peagle", "target_temperature"): 1.0,
                                             ("peagle", "loss_positions"): "assistant",
                                             ("peagle", "feature_noise"): 0.0,
                                             ("optim", "ema_decay"): 0.0,
                                             ("peagle", "logit_mse"): 0.0,
                                             ("draft", "mask_hidden_init"): "random",
                                             ("optim", "layer_lr_scale"): 1.0,
                                             ("draft", "init_from"): None,
                                             ("resources", "engine"): None,
                                             ("resources", "trainer"): None}


def spec_hash(spec: dict[str, Any]) -> str:
    """The run folder name of a (validated, dumped) spec."""
    spec = json.loads(json.dumps(spec))
    spec.pop("preview", None)  # a section added later that changes nothing of the run (docs/decisions.md decision 33)
    for (section, field), value in ADDED_FIELDS.items():
        if spec.get(section, {}).get(field, value) == value:
            spec.get(section, {}).pop(field, None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def data_dir(spec: dict[str, Any]) -> Path:
    """The shared data directory of `spec`: DATA when its prepared data is the preset's (the pipeline's own
    `data_cache_key`: target, data, vocabulary, packing), else one per key."""
    from peagle.data.prepare import data_cache_key
    from peagle.spec import parse_spec

    key = data_cache_key(parse_spec(spec))
    if key == data_cache_key(parse_spec(variant_spec({}))):
        return DATA
    return BASE / f"data-{key[:12]}"


def needs_baseline(names: list[str]) -> bool:
    """Whether running `names` needs the baseline trained first: the peer trains on its run's features. Any
    other variant prepares the data it needs when its data directory has none (the first run on the preset's
    data writes DATA, and every later one reuses it), so it does not wait for the baseline's training."""
    return "peer" in names


def link_data(run: Path, data: Path = DATA) -> None:
    """RUN/data = the shared data directory: small files copied, feature shards linked (nothing is written
    through a link, so runs cannot change each other's data)."""
    dst = run / "data"
    if dst.exists():
        return
    for src in sorted(data.rglob("*")):
        if src.is_dir() or ".engine" in src.relative_to(data).parts[:-1] or src.parent.name == "stream":
            continue
        out = dst / src.relative_to(data)
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".safetensors" and src.parent.parent.name == "features":
            out.symlink_to(src.resolve())
        else:
            shutil.copy2(src, out)


def _child_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: a run's cost, which the other jobs
    on a shared machine change far less than its wall time."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _log_lines(run: Path) -> list[str]:
    lines = []
    for line in (run / "progress.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "log":
            lines.append(str(rec.get("message")))
    return lines


def train(name: str, spec: dict[str, Any]) -> Path:
    """The run of `spec` (trained now unless it already has an export)."""
    run = RUNS / spec_hash(spec)
    if (run / "export" / "config.json").exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps(spec, indent=1))
    data = data_dir(spec)
    fresh_data = not (data / "prepared.pt").exists()
    if not fresh_data:
        link_data(run, data)
    print(f"==> training {name} into {run.relative_to(ROOT)}", flush=True)
    load0, t0, cpu0 = os.getloadavg(), time.time(), _child_cpu()
    with (run / "train.log").open("a") as log:
        subprocess.run([sys.executable, "-m", "peagle", "train", str(run / "spec.json"), "--out", str(run),
                        "--resume", "auto"], check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    facts = {"train_wall_seconds": round(time.time() - t0, 1), "train_cpu_seconds": round(_child_cpu() - cpu0, 1),
             "load_average": [load0, os.getloadavg()]}
    (run / "bench_train.json").write_text(json.dumps(facts))
    if fresh_data:  # the first run prepared the data every later run reuses
        shutil.copytree(run / "data", data, symlinks=True, ignore=shutil.ignore_patterns(".engine", "stream"))
    else:
        logs = _log_lines(run)
        if not any("prepared data reloaded" in m for m in logs) or any("capture engine" in m for m in logs):
            raise RuntimeError(f"{run}: the run did not reuse the shared data (see {run / 'progress.jsonl'})")
    return run


def train_peer(baseline: Path, spec: dict[str, Any]) -> Path:
    """The peer draft on the baseline run's features (the data directory of its `spec`, which is the
    preset's own only for variants on the preset's data), spec (resolved), steps and seed."""
    run = RUNS / f"peer-{baseline.name}"
    if (run / "export" / "config.json").exists():
        return run
    run.mkdir(parents=True, exist_ok=True)
    link_data(run, data_dir(spec))
    shutil.copy2(baseline / "resolved_spec.json", run / "resolved_spec.json")
    print(f"==> training the peer (speculators 0.9.0) into {run.relative_to(ROOT)}", flush=True)
    load0, t0, cpu0 = os.getloadavg(), time.time(), _child_cpu()
    subprocess.run([str(PEER_PY), str(ROOT / "bench" / "peer_train_al.py"), "--run", str(run),
                    "--out", str(run / "export"), "--log", str(run / "train.jsonl")],
                   check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    facts = {"train_wall_seconds": round(time.time() - t0, 1), "train_cpu_seconds": round(_child_cpu() - cpu0, 1),
             "load_average": [load0, os.getloadavg()]}
    (run / "bench_train.json").write_text(json.dumps(facts))
    return run


def measure(run: Path, prompts: str = "humaneval") -> dict[str, Any]:
    """vLLM's AL of RUN/export at K = 4 on `prompts` (cached in the run)."""
    tail = "" if prompts == "humaneval" else f"_{prompts}"
    cache = run / f"al_vllm_k{SERVE_K}_{NUM_PROMPTS}x{MAX_NEW_TOKENS}{tail}.json"
    if cache.exists():
        return dict(json.loads(cache.read_text()))
    load0, t0 = os.getloadavg(), time.time()
    out = subprocess.run(
        [sys.executable, "-m", "peagle", "eval", str(run / "export"), "--engine", "vllm", "--prompts", prompts,
         "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS),
         "--num-speculative-tokens", str(SERVE_K), "--json"],
        check=True, cwd=ROOT, capture_output=True, text=True,
    ).stdout
    rep = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    rep["bench"] = {"wall_seconds": round(time.time() - t0, 1), "load_average": [load0, os.getloadavg()]}
    cache.write_text(json.dumps(rep))
    return dict(rep)


def held_out(run: Path) -> dict[str, Any]:
    """Held-out metrics of the exported (best) checkpoint: tau_sim over the trained depths and over the
    first 4 (comparable across K), per-depth accuracy."""
    best: dict[str, Any] = {}
    if not (run / "progress.jsonl").exists():
        return best
    for line in (run / "progress.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "checkpoint" and rec.get("is_best"):
            best = {"step": rec["step"], **rec.get("metrics", {})}
    accs = [best[f"eval_acc_{d}"] for d in range(32) if f"eval_acc_{d}" in best]
    tau4, prod = 0.0, 1.0
    for a in accs[:SERVE_K]:
        prod *= a
        tau4 += prod
    return {"step": best.get("step"), "tau_sim": best.get("eval_tau_sim"), "tau_sim_k4": round(tau4, 4) if accs
            else None, "acc": [round(a, 4) for a in accs]}


def row(name: str, run: Path) -> dict[str, Any]:
    knob, value, _ = VARIANTS.get(name, (name, None, {}))
    ev, chat = measure(run), measure(run, "sharegpt-heldout")
    facts = json.loads((run / "bench_train.json").read_text()) if (run / "bench_train.json").exists() else {}
    return {
        "knob": knob,
        "value": value,
        "run": str(run.relative_to(ROOT)),
        "al": ev.get("acceptance_length"),
        "per_position": [round(x, 4) for x in ev.get("per_position") or []],
        "num_drafts": ev.get("num_drafts"),
        "al_sharegpt_heldout": chat.get("acceptance_length"),
        "per_position_sharegpt_heldout": [round(x, 4) for x in chat.get("per_position") or []],
        "held_out": held_out(run),
        "train_wall_seconds": facts.get("train_wall_seconds"),
        "train_cpu_seconds": facts.get("train_cpu_seconds"),
        "train_load_average": facts.get("load_average"),
        "eval_load_average": (ev.get("bench") or {}).get("load_average"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated names, or all")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--peer-of", default="baseline",
                    help="the variant whose run (features, resolved spec, positions) the peer trains on")
    args = ap.parse_args()
    if args.list:
        for name, (knob, value, over) in VARIANTS.items():
            print(f"{name:14s} {knob} = {value}  {over}")
        return 0
    from peagle.engine.locate import vllm_python

    RESULTS.mkdir(parents=True, exist_ok=True)
    if vllm_python() is None:
        (RESULTS / "method.json").write_text(json.dumps({"skipped": "no vLLM venv (make vllm-env)"}))
        print("skipped: no vLLM venv (make vllm-env)")
        return 0
    names = list(VARIANTS) if args.variants == "all" else [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; --list shows them")
    if args.peer_of not in VARIANTS or args.peer_of == "peer":
        raise SystemExit(f"--peer-of {args.peer_of!r}: not a variant of ours; --list shows them")
    specs = {n: variant_spec(VARIANTS[n][2]) for n in VARIANTS if n != "peer"}
    baseline = RUNS / spec_hash(specs[args.peer_of])  # what the peer is paired with
    if needs_baseline(names):
        baseline = train(args.peer_of, specs[args.peer_of])  # first: the peer trains on its run's features
    for name in names:
        run = train_peer(baseline, specs[args.peer_of]) if name == "peer" else train(name, specs[name])
        measure(run)
        measure(run, "sharegpt-heldout")

    rows: dict[str, Any] = {}  # every variant measured so far, in VARIANTS order, one row per run
    first: dict[Path, str] = {}
    for name in VARIANTS:
        run = RUNS / (f"peer-{baseline.name}" if name == "peer" else spec_hash(specs[name]))
        if run in first:  # the same spec as an earlier variant (e.g. the preset's own value)
            rows[first[run]].setdefault("same_as", []).append(name)
        elif (run / f"al_vllm_k{SERVE_K}_{NUM_PROMPTS}x{MAX_NEW_TOKENS}.json").exists():
            rows[name], first[run] = row(name, run), name
    base_al = rows.get("baseline", {}).get("al")  # None until the baseline is measured
    for name, r in rows.items():  # against what the variant is paired with
        r["paired_with"] = args.peer_of if name == "peer" else "baseline" if name in OF_THE_DEMO else "demo_640"
        paired = rows.get(r["paired_with"], {}).get("al")
        r["ratio"] = round(r["al"] / paired, 4) if r["al"] and paired else None
    report: dict[str, Any] = {
        "settings": {"prompts": "humaneval", "num_prompts": NUM_PROMPTS, "max_new_tokens": MAX_NEW_TOKENS,
                     "num_speculative_tokens": SERVE_K, "engine": "vllm", "data": str(DATA.relative_to(ROOT)),
                     "cpu_count": os.cpu_count()},
        "variants": rows,
        "demo_al": {"al": base_al, "ratio": round(base_al / TARGET_AL, 4) if base_al else None,
                    "target": f">= 1 (AL >= {TARGET_AL})", "pass": bool(base_al and base_al >= TARGET_AL)},
    }
    ours_al = rows.get(args.peer_of, {}).get("al")
    if "peer" in rows and rows["peer"]["al"] and ours_al:
        ratio = ours_al / rows["peer"]["al"]
        report["ours_vs_peer"] = {"ours": args.peer_of, "al": ours_al, "peer_al": rows["peer"]["al"],
                                  "ratio": round(ratio, 4), "target": f">= {TARGET_VS_PEER}",
                                  "pass": ratio >= TARGET_VS_PEER}
    (RESULTS / "method.json").write_text(json.dumps(report, indent=1))
    print(f"{'variant':14s} {'knob':36s} {'value':>8s} {'AL':>7s} {'ratio':>7s} {'chat AL':>7s} {'tau4':>7s}  "
          "per-position")
    for name, r in rows.items():
        print(f"{name:14s} {r['knob'][:36]:36s} {r['value']!s:>8s} {r['al'] or 0:7.4f} {r['ratio'] or 0:7.4f} "
              f"{r['al_sharegpt_heldout'] or 0:7.4f} {r['held_out'].get('tau_sim_k4') or 0:7.4f}  {r['per_position']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
