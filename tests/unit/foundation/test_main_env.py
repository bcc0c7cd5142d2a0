"""`python -m peagle` bounds oneDNN's kernel caches before torch starts (CPU memory of long runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = (
    "import os, runpy, sys, json\n"
    "sys.argv = ['peagle', '--help']\n"
    "try:\n"
    "    runpy.run_module('peagle', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    "print(json.dumps({k: os.environ.get(k) for k in ('LRU_CACHE_CAPACITY', 'ONEDNN_PRIMITIVE_CACHE_CAPACITY')}))\n"
)


def _run(extra: dict[str, str]) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_bounds_onednn_caches_unless_the_user_set_them():
    assert _run({}) == {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
    assert _run({"LRU_CACHE_CAPACITY": "500"})["LRU_CACHE_CAPACITY"] == "500"
