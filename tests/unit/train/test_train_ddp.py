"""DDP: two gloo processes on CPU give the loss and weights of one process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_draft, tiny_source, tiny_spec

from peagle.train.loop import Trainer

SCRIPT = Path(__file__).parent / "run_tiny_training.py"


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_two_gloo_ranks_match_one_process(tmp_path: Path, ema: float) -> None:
    # Same spec as run_tiny_training.py: 2 rows per micro-batch (one per rank), 2 micro-batches per step.
    # With a weight average (optim.ema_decay), the weights compared are the run's result: the average.
    spec = tiny_spec(optim={"max_steps": 3, "epochs": 10, "grad_accumulation": 2, "ema_decay": ema},
                     peagle={"sequence_partitions": 2})
    single = Trainer(spec, tiny_draft(), tiny_source(num_batches=3))
    ref = single.train()

    out = tmp_path / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPT), "--steps", "3", "--ema", str(ema), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    assert len(ddp["losses"]) == 3
    torch.testing.assert_close(torch.tensor(ddp["losses"]), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for name, value in single.draft.state_dict().items():
        torch.testing.assert_close(ddp["weights"][name], value, rtol=1e-4, atol=1e-6, msg=name)
