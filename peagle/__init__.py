"""P-EAGLE draft training: data, target capture, the draft and its trainer, evaluation and export."""

ONEDNN_CACHE_BOUNDS = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
"""Environment bounds on oneDNN's two kernel caches that training processes start with (see `peagle.__main__`)."""
