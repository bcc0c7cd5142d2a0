"""P-EAGLE draft training: batch protocol, partitioned step, loop, checkpoints, progress, DDP.

Modules: `batch` (the `BatchSource` protocol), `step` (one micro-batch: COD, segments, forward/backward),
`loop` (`Trainer`), `checkpoint` (crash-safe checkpoints), `optim` (AdamW + schedule), `progress`
(`ProgressSink`), `signals` (graceful SIGTERM), `ddp` (torchrun helpers). Import from the submodules;
this package imports nothing at import time.
"""
