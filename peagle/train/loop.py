"""The training loop: optimizer steps over a `BatchSource`, evaluation, checkpoints, resume, signals.

Data position. Micro-batch j of the run (0-based, over all epochs) is `(epoch, index) = divmod(j, nb)`;
optimizer step s consumes micro-batches `s*A .. s*A+A-1` (A = grad_accumulation; the last step of the
run may be shorter). The position of a run is therefore just its step number, and since the COD draw
of every row is keyed by (seed, epoch, index, row), a run resumed from a checkpoint of step s computes
exactly the losses and weights of an uninterrupted run.

    trainer = Trainer(spec, draft, train_source, run_dir=run, eval_source=held_out, sink=sink,
                      extra_writer=write_export)
    result = trainer.train()        # raises TrainingInterrupted after a SIGTERM (checkpoint saved)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.cod.loss import LOSS_EPS, CodMetrics
from peagle.cod.rows import weight_sum
from peagle.data.packing import next_in_document
from peagle.errors import TrainingInterrupted
from peagle.model.attention import select_attention
from peagle.model.draft import PEagleDraft
from peagle.progress import NullSink, ProgressSink
from peagle.run_folder import CHECKPOINTS, checkpoint_relpath
from peagle.spec import TrainSpec
from peagle.spec.metrics import TOKENS_PER_S, eval_key
from peagle.train.batch import BatchSource, select_rows
from peagle.train.checkpoint import (
    find_resumable,
    load_training_state,
    save_checkpoint,
)
from peagle.train.ddp import DistContext, all_reduce_row_grads, wrap_ddp
from peagle.train.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    ema_beta,
    total_steps,
    update_ema,
)
from peagle.train.signals import GracefulShutdown, stop_reason
from peagle.train.step import (
    EVAL_EPOCH,
    DraftObjective,
    StepSettings,
    StepTimes,
    add_feature_noise,
    noise_generator,
    plan_rows,
    run_micro_batch,
)

__all__ = ["TrainResult", "Trainer", "resolve_device"]

STATE_FORMAT = 1


def resolve_device(spec: TrainSpec) -> torch.device:
    """`resources.device` as `TrainSpec.resolve` decides it (auto = CUDA when available)."""
    return torch.device(spec.resolve(cuda_available=torch.cuda.is_available()).resources.device)


@dataclass
class TrainResult:
    """Where a finished run stands."""

    step: int
    total_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)  # loss of every step run by this process
    last_checkpoint: Path | None = None


class Trainer:
    """Trains a `PEagleDraft` on a `BatchSource` as the spec says.

    Args:
        spec: the resolved job spec (optim, peagle, checkpoints, resources sections are read).
        draft: the draft, initialised (`init_from_target`) and built under the run's seed.
        train_source: training micro-batches.
        run_dir: RUN (checkpoints go to RUN/checkpoints); None = no checkpoints, no resume.
        eval_source: held-out micro-batches (eval_loss, eval_tau_sim, eval_acc_d); None = no eval.
        sink: progress sink (rank 0 only reports).
        extra_writer: `extra_writer(tmp_dir, draft)` adds the vLLM export to every checkpoint.
        evaluate_hook: `evaluate_hook(draft, step) -> dict` extra metrics (the measured acceptance_length)
            at every checkpoint and every `eval.al_every_steps` steps, at most once a step; runs on rank 0.
        dist: the DDP context (`init_distributed()`); None = one process.
        device: overrides `resources.device`.
        resume: `auto` continues from the newest complete checkpoint in RUN/checkpoints; `never` ignores it.
        resume_from: with `auto`, the checkpoint the caller already chose with `find_resumable` (verified),
            so it is not searched and hashed again; None = the Trainer searches.
    """

    def __init__(
        self,
        spec: TrainSpec,
        draft: PEagleDraft,
        train_source: BatchSource,
        *,
        run_dir: Path | None = None,
        eval_source: BatchSource | None = None,
        sink: ProgressSink | None = None,
        extra_writer: Callable[[Path, Any], None] | None = None,
        evaluate_hook: Callable[[PEagleDraft, int], dict[str, float]] | None = None,
        dist: DistContext | None = None,
        device: torch.device | str | None = None,
        resume: str = "auto",
        resume_from: Path | None = None,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device) if device is not None else resolve_device(spec)
        self.dist = dist or DistContext(device=self.device if self.device.type == "cuda" else torch.device("cpu"))
        self.draft = draft.to(self.device)
        self.source, self.eval_source = train_source, eval_source
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.sink: ProgressSink = (sink or NullSink()) if self.dist.is_main else NullSink()
        self.extra_writer, self.evaluate_hook = extra_writer, evaluate_hook
        self.resume, self.resume_from = resume, resume_from
        p, o, r = spec.peagle, spec.optim, spec.resources
        resolved = spec.resolve(cuda_available=self.device.type == "cuda")
        r = resolved.resources
        #: the checkpoint ranking, `auto` resolved: measured AL when eval prompts exist, else tau_sim
        self.select_best_by = resolved.checkpoints.select_best_by
        bf16 = self.device.type == "cuda" and r.precision == "bf16"
        self.settings = StepSettings(
            num_depths=p.num_depths,
            down_sample_ratio=p.down_sample_ratio,
            down_sample_ratio_min=p.down_sample_ratio_min,
            max_anchors=p.max_anchors,
            sequence_partitions=p.sequence_partitions,
            mask_token_id=draft.config.mask_token_id,
            attention=select_attention(self.device, r.attention),
            autocast_dtype=torch.bfloat16 if bf16 else None,
            seed=o.seed,
            depth_decay=p.depth_decay,
            release_memory=p.sequence_partitions > 1,  # partitioning = trading time for memory
        )
        draft.set_trainable(freeze_embeddings=spec.draft.freeze_embeddings, freeze_lm_head=spec.draft.freeze_lm_head)
        draft.gradient_checkpointing = p.gradient_checkpointing
        self.objective = DraftObjective(draft, p.num_depths, self.settings.autocast_dtype, p.target_temperature,
                                        p.logit_mse)
        self.optimizer = build_optimizer(draft, o)
        self.num_batches = train_source.num_batches()
        self.total_steps = total_steps(o, self.num_batches)
        self.scheduler = build_scheduler(self.optimizer, o, self.total_steps)
        self.step = 0
        #: `optim.ema_decay` > 0: the moving average of the trainable weights (fp32, on the device); what
        #: evaluation, live AL and checkpoints' drafts use (`averaged`)
        self.ema: dict[str, torch.Tensor] | None = (
            {n: q.detach().clone() for n, q in draft.named_parameters() if q.requires_grad}
            if o.ema_decay > 0 else None
        )
        self.interval = CodMetrics.zeros(p.num_depths)  # training metric sums since the last checkpoint
        self.last_eval: dict[str, float] = {}
        self._measured: tuple[int, dict[str, float]] | None = None  # (step, evaluate_hook result)

    # ----------------------------------------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path | None:
        return self.run_dir / CHECKPOINTS if self.run_dir is not None else None

    def _micro_range(self, step: int) -> range:
        a = self.spec.optim.grad_accumulation
        end = self.spec.optim.epochs * self.num_batches
        return range(step * a, min((step + 1) * a, end))

    def _load_batch(self, source: BatchSource, epoch: int, index: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        rows = self.dist.rows(self._batch_size(source)) if self.dist.enabled else None
        batch = select_rows(source, epoch, index, rows)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        row_ids = rows if rows is not None else list(range(batch["input_ids"].shape[0]))
        return batch, row_ids

    def _batch_size(self, source: BatchSource) -> int:
        size = getattr(source, "batch_size", None)
        return int(size) if isinstance(size, int) else self.spec.optim.micro_batch_size

    @contextlib.contextmanager
    def averaged(self) -> Iterator[PEagleDraft]:
        """The draft with the moving average's weights for the duration (the trained ones restored after);
        the draft itself when `optim.ema_decay` is 0."""
        if self.ema is None:
            yield self.draft
            return
        params = dict(self.draft.named_parameters())
        trained = {n: params[n].detach().clone() for n in self.ema}
        self._load_weights(self.ema)
        try:
            yield self.draft
        finally:
            self._load_weights(trained)

    @torch.no_grad()
    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy `weights` into the draft's parameters of the same names, in place."""
        params = dict(self.draft.named_parameters())
        for n, w in weights.items():
            params[n].copy_(w)

    # ----------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Run (or continue) training to the last step; checkpoints, eval and progress on the way.

        Raises:
            TrainingInterrupted: after the first SIGTERM/SIGINT (a checkpoint of the finished step
                was saved when `run_dir` is set).
        """
        self._maybe_resume()
        embed = self.draft.embed_tokens.weight
        # the sparse embedding gradient is averaged by all_reduce_row_grads, not by DDP's dense buckets
        row_params = ["draft.embed_tokens.weight"] if embed.requires_grad else []
        model = wrap_ddp(self.objective, self.dist, row_params=row_params)
        result = TrainResult(step=self.step, total_steps=self.total_steps)
        self.sink.event("phase", phase="training", message=f"training {self.total_steps} steps from step {self.step}")
        every = self.spec.checkpoints.every_steps
        eval_every = self.spec.eval.every_steps
        al_every = self.spec.eval.al_every_steps
        with GracefulShutdown() as stop:
            while self.step < self.total_steps:
                values = self._train_step(model)
                result.losses.append(values["loss"])
                result.metrics = values
                epoch = self._micro_range(self.step - 1).stop / self.num_batches
                if eval_every and self.step % eval_every == 0:
                    values.update(self.evaluate())
                if al_every and self.step % al_every == 0:
                    values.update(self.measure())
                self.sink.metric(self.step, epoch, values)
                self.sink.event("progress", step=self.step, total_steps=self.total_steps, epoch=epoch)
                stopping = self.dist.any(stop.requested)
                if self.step % every == 0 or self.step == self.total_steps or stopping:
                    result.last_checkpoint = self.checkpoint(epoch, interrupted=stopping)
                if stopping:  # a pause (or Ctrl-C): logged as what it is, not as an error
                    why = stop_reason(stop.signum)
                    self.sink.log("info", f"paused at step {self.step}: {why}; checkpoint saved")
                    raise TrainingInterrupted(f"paused at step {self.step} ({why}); resume with --resume auto")
        result.step = self.step
        result.eval_metrics = dict(self.last_eval)
        if self.ema is not None:  # the run's result is the average (the trained weights stay in the checkpoints)
            self._load_weights(self.ema)
        return result

    def _train_step(self, model: torch.nn.Module) -> dict[str, float]:
        self.objective.train()
        times = StepTimes()
        t_start = time.perf_counter()
        micro = self._micro_range(self.step)
        sums = CodMetrics.zeros(self.settings.num_depths, device=self.device)
        tokens = 0
        for j in micro:
            t0 = time.perf_counter()
            epoch, index = divmod(j, self.num_batches)
            batch, row_ids = self._load_batch(self.source, epoch, index)
            if self.spec.peagle.loss_positions == "all":  # prompts too; held-out metrics keep the assistant mask
                batch = {**batch, "loss_mask": next_in_document(batch["document_ids"]).to(batch["loss_mask"].dtype)}
            if self.spec.peagle.feature_noise > 0:  # training only: held-out metrics see the clean features
                gens = [noise_generator(self.spec.optim.seed, epoch, index, gid) for gid in row_ids]
                batch = {**batch, "aux": add_feature_noise(batch["aux"], self.spec.peagle.feature_noise, gens)}
            rows = plan_rows(batch, self.settings, epoch=epoch, index=index, row_ids=row_ids)
            den = self.dist.all_reduce_sum(weight_sum(rows).to(self.device)).clamp_min(LOSS_EPS)
            tokens += int((batch["document_ids"] >= 0).sum())
            times.fetch += time.perf_counter() - t0
            scale = self.dist.world_size / (den * len(micro))
            sums = sums + run_micro_batch(
                model, self.draft, batch, rows, self.settings, scale=scale, sync=j == micro[-1], times=times
            )
        t0 = time.perf_counter()
        params = [p for p in self.draft.parameters() if p.requires_grad]
        embed = self.draft.embed_tokens.weight
        all_reduce_row_grads([embed] if embed.requires_grad else [], self.dist)
        # the norm counts the sparse embedding rows exactly (torch's clip_grad_norm_ takes no sparse grad)
        grad_norm = clip_grad_norm(params, self.spec.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema is not None:
            update_ema(self.ema, dict(self.draft.named_parameters()), ema_beta(self.spec.optim.ema_decay, self.step))
        times.optimizer = time.perf_counter() - t0
        vec = torch.cat([sums.stacked().cpu(), torch.tensor([float(tokens)], dtype=torch.float64)])
        vec = self.dist.all_reduce_sum(vec)
        reduced = CodMetrics.from_stacked(vec[:-1])
        self.interval = self.interval + reduced
        elapsed = time.perf_counter() - t_start
        values = reduced.finalize()
        values[TOKENS_PER_S] = float(vec[-1]) / max(elapsed, 1e-9)
        values.update(
            lr=float(lr),
            grad_norm=float(grad_norm),
            time_fetch=times.fetch,
            time_forward=times.forward,
            time_backward=times.backward,
            time_optimizer=times.optimizer,
        )
        return values

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (`eval_loss`, `eval_tau_sim`, `eval_acc_d`, `eval_full_acc`); {} without a source."""
        if self.eval_source is None or self.eval_source.num_batches() == 0:
            return {}
        self.objective.eval()
        sums = CodMetrics.zeros(self.settings.num_depths, device=self.device)
        with self.averaged() as draft:
            for index in range(self.eval_source.num_batches()):
                batch, row_ids = self._load_batch(self.eval_source, 0, index)
                rows = plan_rows(batch, self.settings, epoch=EVAL_EPOCH, index=index, row_ids=row_ids)
                sums = sums + run_micro_batch(self.objective, draft, batch, rows, self.settings, scale=None)
        self.objective.train()
        reduced = CodMetrics.from_stacked(self.dist.all_reduce_sum(sums.stacked().cpu()))
        self.last_eval = {eval_key(k): v for k, v in reduced.finalize().items()}
        self.sink.event("eval", step=self.step, metrics=self.last_eval)
        return dict(self.last_eval)

    def measure(self) -> dict[str, float]:
        """`evaluate_hook` of the current step (measured AL), run at most once a step; {} without a hook
        or off rank 0."""
        if self.evaluate_hook is None or not self.dist.is_main:
            return {}
        if self._measured is None or self._measured[0] != self.step:
            with self.averaged() as draft:
                self._measured = (self.step, self.evaluate_hook(draft, self.step))
        return dict(self._measured[1])

    # ----------------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """Everything a resumed run needs (fp32 weights, optimizer, scheduler, RNG, position)."""
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "step": self.step,
            "micro_batch": self._micro_range(self.step).start,
            "epoch": self._micro_range(self.step).start / self.num_batches,
            # copies, not views: `checkpoint` swaps the average into the draft while this state is saved
            "draft": {k: v.detach().to("cpu", torch.float32, copy=True) if v.is_floating_point() else v.cpu().clone()
                      for k, v in self.draft.state_dict().items()},
            "draft_config": self.draft.config.to_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "interval": self.interval.stacked().cpu(),
            "last_eval": dict(self.last_eval),
            "rng_cpu": torch.get_rng_state(),
        }
        if self.ema is not None:
            state["ema"] = {n: t.detach().to("cpu") for n, t in self.ema.items()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def checkpoint(self, epoch: float, *, interrupted: bool = False) -> Path | None:
        """Save a checkpoint of the current step (rank 0), with eval metrics unless interrupted."""
        if self.ckpt_root is None:
            return None
        metrics = self.interval.finalize()
        if not interrupted:
            if self.spec.eval.every_steps is None or not self.last_eval:
                self.evaluate()
            fresh = self._measured is None or self._measured[0] != self.step
            measured = self.measure()
            metrics.update(measured)
            if fresh and measured:  # not in this step's metric record yet: an eval record of its own
                self.sink.event("eval", step=self.step, metrics=measured)
        metrics.update(self.last_eval)
        if not interrupted:
            self.interval = CodMetrics.zeros(self.settings.num_depths)
        path = None
        if self.dist.is_main:
            state = self.training_state()  # the trained weights (and the average) for resuming
            with self.averaged() as draft:  # the checkpoint's draft and export: the average
                info = save_checkpoint(
                    self.ckpt_root,
                    step=self.step,
                    epoch=epoch,
                    training_state=state,
                    metrics=metrics,
                    draft=draft,
                    extra_writer=self.extra_writer,
                    keep_last=self.spec.checkpoints.keep_last,
                    select_best_by=self.select_best_by,
                )
            self.sink.event("checkpoint", step=self.step, dir=info.dir, files=info.files, metrics=metrics,
                            is_best=info.is_best)
            path = info.path
        self.dist.barrier()
        return path

    def _maybe_resume(self) -> None:
        if self.resume != "auto" or self.ckpt_root is None:
            return
        path = self.resume_from or find_resumable(self.ckpt_root,
                                                  warn=lambda m: self.sink.event("warning", message=m))
        if path is None:
            return
        state = load_training_state(path)
        self.draft.load_state_dict(state["draft"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            if "ema" not in state:
                raise ValueError(f"{path.name} holds no weight average (optim.ema_decay was 0 when it was "
                                 "saved); resume with the spec it was trained with, or start a new run")
            self.ema = {n: state["ema"][n].to(self.device, torch.float32) for n in self.ema}
        self.step = int(state["step"])
        self.interval = CodMetrics.from_stacked(state["interval"].to(torch.float64))
        self.last_eval = dict(state.get("last_eval", {}))
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and self.device.type == "cuda":
            with contextlib.suppress(RuntimeError):
                torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        self.sink.event("resumed", step=self.step, dir=checkpoint_relpath(self.step),
                        message=f"resumed from {path.name}")
