"""The training loop: learning, exact resume (in-process and after SIGTERM/SIGKILL), progress records."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import tiny_draft, tiny_source, tiny_spec

from peagle.data.packing import next_in_document
from peagle.progress import RecordingSink
from peagle.train.checkpoint import load_training_state, read_state
from peagle.train.loop import Trainer
from peagle.train.optim import ema_beta

HERE = Path(__file__).parent
SCRIPT = HERE / "run_tiny_training.py"


def test_loss_falls_on_a_fixed_tiny_batch() -> None:
    # K=1: depth 0 only, so the batch is exactly the same every step (deeper COD draws change per epoch).
    spec = tiny_spec(
        optim={"lr": 1e-2, "epochs": 40, "schedule": "constant", "warmup_ratio": 0.0},
        peagle={"num_depths": 1},
    )
    result = Trainer(spec, tiny_draft(), tiny_source(num_batches=1, learnable=True)).train()
    assert len(result.losses) == 40
    assert result.losses[-1] < 0.75 * result.losses[0]


def test_resume_in_process_continues_exactly(tmp_path: Path) -> None:
    spec = tiny_spec(optim={"epochs": 2, "grad_accumulation": 1})  # 8 steps, checkpoints every 2
    ref_trainer = Trainer(spec, tiny_draft(), tiny_source())
    ref = ref_trainer.train()

    sink = RecordingSink()
    Trainer(spec, tiny_draft(), tiny_source(), run_dir=tmp_path, sink=sink).train()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) in (["step_000006", "step_000008"],
                                                           ["step_000004", "step_000006", "step_000008"])
    shutil.rmtree(ckpts / "step_000008")  # as if the run had died after step 6
    resumed_sink = RecordingSink()
    resumed = Trainer(spec, tiny_draft(seed=5), tiny_source(), run_dir=tmp_path, sink=resumed_sink)
    out = resumed.train()
    assert out.losses == ref.losses[6:]
    assert any(r.get("kind") == "resumed" and r["step"] == 6 for r in resumed_sink.records)
    # final weights identical to the uninterrupted run
    for name, value in ref_trainer.draft.state_dict().items():
        assert torch.equal(value, resumed.draft.state_dict()[name]), name

    # progress records: metric keys and checkpoint events with real sha256
    metrics = [r for r in sink.records if r["type"] == "metric"]
    keys = set(metrics[0]["values"])
    expected = {"loss", "acc_0", "acc_3", "full_acc", "tau_sim", "lr", "grad_norm", "tokens_per_s",
                "time_fetch", "time_forward", "time_backward", "time_optimizer"}
    assert expected <= keys
    events = [r for r in sink.records if r.get("kind") == "checkpoint"]
    last = events[-1]
    assert last["dir"] == "checkpoints/step_000008" and last["step"] == 8
    phases = [r["phase"] for r in sink.records if r.get("kind") == "phase"]
    assert phases == ["training"]
    state = read_state(ckpts)
    assert state["latest"] == "step_000008"


def _wait_for_step(progress: Path, step: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        if progress.exists():
            for line in progress.read_text().splitlines():
                rec = json.loads(line)
                if rec["type"] == "metric" and rec["step"] >= step:
                    return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _spawn(run: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run), *extra], env=env)


def test_resume_after_sigterm_and_sigkill_gives_the_uninterrupted_weights(tmp_path: Path) -> None:
    # Reference: the same run, uninterrupted, in this process.
    spec = tiny_spec(optim={"max_steps": 10, "epochs": 10, "grad_accumulation": 2},
                     peagle={"sequence_partitions": 2})
    reference = Trainer(spec, tiny_draft(), tiny_source(num_batches=3))
    ref = reference.train()

    run = tmp_path / "run"
    proc = _spawn(run, "--slow", "0.15", "--steps", "10")
    _wait_for_step(run / "progress.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)  # finish the step, checkpoint, exit 75
    assert proc.wait(timeout=60) == 75
    state = read_state(run / "checkpoints")
    stopped_at = int(state["latest"].split("_")[1])
    assert 2 <= stopped_at < 7

    proc = _spawn(run, "--slow", "0.15", "--steps", "10")
    _wait_for_step(run / "progress.jsonl", stopped_at + 2, proc)
    proc.kill()  # SIGKILL: no chance to save; possibly mid-checkpoint
    proc.wait(timeout=30)

    out = tmp_path / "final.pt"
    proc = _spawn(run, "--out", str(out), "--steps", "10")
    assert proc.wait(timeout=90) == 0
    final = torch.load(out, weights_only=True)
    for name, value in reference.draft.state_dict().items():
        assert torch.equal(value, final["weights"][name]), name
    assert final["losses"] == ref.losses[-len(final["losses"]):]

    meta = json.loads((run / "checkpoints" / "step_000010" / "meta.json").read_text())
    for f in meta["files"]:
        data = (run / "checkpoints" / "step_000010" / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]


def test_loss_positions_all_trains_every_in_document_slot_and_keeps_held_out_on_the_answers() -> None:
    """`peagle.loss_positions` "all": a training step supervises every slot whose next token is in its
    document (prompts included), "assistant" only the loss mask's; held-out metrics score the loss mask in
    both, so the two runs' eval numbers stay comparable."""
    source = tiny_source(num_batches=1)
    batch = source.batch(0, 0)
    answers, every = int(batch["loss_mask"].sum()), int(next_in_document(batch["document_ids"]).sum())
    assert 0 < answers < every  # the synthetic rows have unsupervised in-document slots

    def one_step(positions: str) -> tuple[Trainer, dict[str, float]]:
        spec = tiny_spec(peagle={"num_depths": 1, "loss_positions": positions})
        trainer = Trainer(spec, tiny_draft(), source, eval_source=source)
        before = trainer.evaluate()
        trainer._train_step(trainer.objective)
        return trainer, before

    assistant, eval_assistant = one_step("assistant")
    everything, eval_all = one_step("all")
    assert float(assistant.interval.acc_total[0]) == answers
    assert float(everything.interval.acc_total[0]) == every
    assert eval_all == eval_assistant  # the same draft before the step: held-out ignores the knob
    assert everything.evaluate() != assistant.evaluate()  # the step itself differed


def test_feature_noise_reaches_the_training_step_only() -> None:
    """`peagle.feature_noise` > 0 changes what a training step computes (the loss of the same draft on the
    same batch) and the weights it leaves, and not the held-out metrics, which see the clean features."""

    def one_step(noise: float) -> tuple[float, dict[str, float], torch.Tensor]:
        spec = tiny_spec(peagle={"num_depths": 2, "feature_noise": noise})
        trainer = Trainer(spec, tiny_draft(), tiny_source(num_batches=1), eval_source=tiny_source(num_batches=1))
        before = trainer.evaluate()
        loss = trainer._train_step(trainer.objective)["loss"]
        return loss, before, trainer.draft.fc.weight.detach().clone()

    clean_loss, clean_eval, clean_fc = one_step(0.0)
    noisy_loss, noisy_eval, noisy_fc = one_step(0.5)
    assert noisy_eval == clean_eval
    assert noisy_loss != clean_loss
    assert not torch.equal(noisy_fc, clean_fc)
    again_loss, _, again_fc = one_step(0.5)  # keyed: the same noise again
    assert again_loss == noisy_loss and torch.equal(again_fc, noisy_fc)


def _assert_resumes_exactly(spec: Any, run_dir: Path) -> tuple[Trainer, Trainer, Any]:
    """Trains `spec` (8 steps, checkpoints every 2) uninterrupted and again into `run_dir`, drops the last
    checkpoint (as if the run had died after step 6) and resumes a differently seeded draft: the resumed
    steps' losses and the final weights must equal the uninterrupted run's. Returns (reference trainer,
    resumed trainer, reference result)."""
    ref_trainer = Trainer(spec, tiny_draft(), tiny_source())
    ref = ref_trainer.train()
    Trainer(spec, tiny_draft(), tiny_source(), run_dir=run_dir).train()
    shutil.rmtree(run_dir / "checkpoints" / "step_000008")
    resumed = Trainer(spec, tiny_draft(seed=5), tiny_source(), run_dir=run_dir)
    assert resumed.train().losses == ref.losses[6:]
    for name, value in ref_trainer.draft.state_dict().items():
        assert torch.equal(value, resumed.draft.state_dict()[name]), name
    return ref_trainer, resumed, ref


def test_feature_noise_and_all_positions_resume_exactly_and_partition_exactly(tmp_path: Path) -> None:
    """The noise is keyed per row (not drawn from a global stream), so a resumed run draws what the
    uninterrupted one drew, and a partitioned step sees the same noisy features as a whole one."""
    knobs = {"feature_noise": 0.2, "loss_positions": "all"}
    _, _, ref = _assert_resumes_exactly(tiny_spec(optim={"epochs": 2}, peagle=knobs), tmp_path)
    parted = Trainer(tiny_spec(optim={"epochs": 2}, peagle={**knobs, "sequence_partitions": 3}), tiny_draft(),
                     tiny_source()).train()
    torch.testing.assert_close(torch.tensor(parted.losses), torch.tensor(ref.losses), rtol=1e-4, atol=1e-6)


def test_weight_average_is_what_evaluation_checkpoints_and_the_result_use(tmp_path: Path) -> None:
    """optim.ema_decay: the trainer keeps the moving average of its weights; held-out metrics, the live-AL hook
    and each checkpoint's draft see the average, the checkpoint's training state keeps the trained weights."""
    spec = tiny_spec(optim={"lr": 1e-2, "epochs": 2, "grad_accumulation": 1, "ema_decay": 0.9})  # 8 steps
    written: dict[int, dict[str, torch.Tensor]] = {}
    hooked: dict[int, dict[str, torch.Tensor]] = {}

    def writer(_tmp: Path, draft: Any) -> None:
        written[len(written)] = {k: v.clone() for k, v in draft.state_dict().items()}

    def hook(draft: Any, step: int) -> dict[str, float]:
        hooked[step] = {k: v.clone() for k, v in draft.state_dict().items()}
        return {}

    trainer = Trainer(spec, tiny_draft(), tiny_source(), run_dir=tmp_path, eval_source=tiny_source(num_batches=1),
                      extra_writer=writer, evaluate_hook=hook)
    # the average by hand, beside the trainer's own steps
    by_hand = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
    trainer._maybe_resume()
    while trainer.step < 3:
        trainer._train_step(trainer.objective)
        beta = ema_beta(0.9, trainer.step)
        for n, p in trainer.draft.named_parameters():
            by_hand[n] = beta * by_hand[n] + (1 - beta) * p.detach()
    assert trainer.ema is not None
    for n in by_hand:
        torch.testing.assert_close(trainer.ema[n], by_hand[n], rtol=1e-6, atol=1e-7)
        assert not torch.equal(trainer.ema[n], dict(trainer.draft.named_parameters())[n]) or n == "mask_hidden"

    trained = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
    ckpt = trainer.checkpoint(epoch=0.75)
    assert ckpt is not None
    for n, p in trainer.draft.named_parameters():  # the trained weights are back after the checkpoint
        assert torch.equal(p, trained[n]), n
    state = load_training_state(ckpt)
    for n in trained:
        assert torch.equal(state["draft"][n], trained[n]), n  # resuming continues the trained weights
        assert torch.equal(state["ema"][n], trainer.ema[n]), n
        assert torch.equal(written[0][n], trainer.ema[n]), n  # the checkpoint's export is the average
        assert torch.equal(hooked[3][n], trainer.ema[n]), n  # so is the live-AL measurement

    # held-out metrics are those of a draft holding the average
    averaged = tiny_draft()
    averaged.load_state_dict({**averaged.state_dict(), **{n: t.clone() for n, t in trainer.ema.items()}})
    reference = Trainer(tiny_spec(), averaged, tiny_source(), eval_source=tiny_source(num_batches=1))
    assert trainer.evaluate() == reference.evaluate()

    trainer.train()  # the rest of the run; its result is the average
    for n, p in trainer.draft.named_parameters():
        assert torch.equal(p, trainer.ema[n]), n


def test_weight_average_resumes_exactly(tmp_path: Path) -> None:
    spec = tiny_spec(optim={"epochs": 2, "grad_accumulation": 1, "ema_decay": 0.8})  # 8 steps, checkpoints every 2
    ref_trainer = Trainer(spec, tiny_draft(), tiny_source())
    ref = ref_trainer.train()

    Trainer(spec, tiny_draft(), tiny_source(), run_dir=tmp_path).train()
    shutil.rmtree(tmp_path / "checkpoints" / "step_000008")  # as if the run had died after step 6
    resumed = Trainer(spec, tiny_draft(seed=5), tiny_source(), run_dir=tmp_path)
    assert resumed.train().losses == ref.losses[6:]
    assert resumed.ema is not None and ref_trainer.ema is not None
    for name, value in ref_trainer.ema.items():
        assert torch.equal(value, resumed.ema[name]), name
    for name, value in ref_trainer.draft.state_dict().items():
        assert torch.equal(value, resumed.draft.state_dict()[name]), name

    # a checkpoint saved without an average cannot seed one
    plain = tmp_path / "plain"
    Trainer(tiny_spec(optim={"epochs": 1}), tiny_draft(), tiny_source(), run_dir=plain).train()
    with pytest.raises(ValueError, match="no weight average"):
        Trainer(tiny_spec(optim={"epochs": 2, "ema_decay": 0.8}), tiny_draft(), tiny_source(), run_dir=plain).train()


def test_layer_lr_scale_resumes_exactly(tmp_path: Path) -> None:
    """The scaled layer groups and their schedule come back from a checkpoint: a run resumed after step 6
    ends where the uninterrupted one does."""
    spec = tiny_spec(optim={"epochs": 2, "grad_accumulation": 1, "layer_lr_scale": 0.3})
    ref_trainer, resumed, _ = _assert_resumes_exactly(spec, tmp_path)
    assert len(resumed.optimizer.param_groups) == 4
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in ref_trainer.optimizer.param_groups]
