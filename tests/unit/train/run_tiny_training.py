"""Subprocess entry of the resume / DDP tests: train the tiny setup (see train_helpers).

    python run_tiny_training.py RUN_DIR [--slow SECONDS] [--steps N] [--out FILE]

Trains with checkpoints in RUN_DIR (resume auto), appends progress to RUN_DIR/progress.jsonl and,
when done, saves the final weights and losses to --out (rank 0). Exit 75 after a SIGTERM.
Under torchrun it joins the gloo process group (DDP).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from train_helpers import tiny_draft, tiny_source, tiny_spec

from peagle.errors import EXIT_CODES, TrainingInterrupted
from peagle.progress import JsonlSink
from peagle.train.ddp import init_distributed, shutdown_distributed
from peagle.train.loop import Trainer


class SlowSource:
    """Delays every batch so a test can signal the process mid-run."""

    def __init__(self, inner: object, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.batch_size = inner.batch_size

    def num_batches(self) -> int:
        return self.inner.num_batches()

    def batch(self, epoch: int, index: int) -> dict:
        time.sleep(self.delay)
        return self.inner.batch(epoch, index)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--ema", type=float, default=0.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    spec = tiny_spec(
        optim={"max_steps": args.steps, "epochs": 10, "grad_accumulation": 2, "ema_decay": args.ema},
        peagle={"sequence_partitions": args.partitions},
    )
    source = tiny_source(num_batches=3)
    trainer = Trainer(
        spec, tiny_draft(), SlowSource(source, args.slow) if args.slow else source,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        eval_source=tiny_source(num_batches=1, seed=99),
        sink=JsonlSink(Path(args.run_dir) / "progress.jsonl") if args.run_dir else None,
        dist=ctx,
    )
    try:
        result = trainer.train()
    except TrainingInterrupted:
        return EXIT_CODES["interrupted"]
    finally:
        shutdown_distributed(ctx)
    if args.out and ctx.is_main:
        torch.save({"losses": result.losses, "weights": trainer.draft.state_dict()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
