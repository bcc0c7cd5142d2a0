"""`python -m peagle ...` runs the CLI (also under `torchrun -m peagle`, the worker's trainer command).

Before torch starts, bound oneDNN's two kernel caches (ideep's `LRU_CACHE_CAPACITY` and oneDNN's
`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024 compiled kernels each by default): `peagle.model.cpu_kernels` runs the CPU
products through oneDNN, which compiles one kernel per matrix shape, and COD rows change shape every step,
so with the defaults a CPU run's memory grew by about 1.3 GB over its first 10 steps (partition-memory
bench, S=4, T=2048) and kept climbing. A value already in the environment wins.
"""

import os

from peagle import ONEDNN_CACHE_BOUNDS

for _name, _value in ONEDNN_CACHE_BOUNDS.items():
    os.environ.setdefault(_name, _value)

from peagle.cli import main  # noqa: E402 - after the cache bounds, before anything imports torch

main()
