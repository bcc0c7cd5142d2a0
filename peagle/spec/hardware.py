"""What the machine runs natively, as the facts `target.dtype: auto` is resolved from (torch-free).

    facts = DeviceFacts(cpu_flags=read_cpu_flags(), cuda_bf16=True)
    auto_target_dtype(device="cpu", facts=facts)     # "bfloat16" on a CPU with avx512_bf16 or amx_bf16

bfloat16 runs natively on a CUDA GPU that supports it (Ampere and later) and on a CPU with AVX512-BF16 or
AMX-BF16; elsewhere (an AVX2-only CPU) it is emulated and vLLM generated 19-26 tokens/s where fp32 is several
times faster, so `auto` is float32 there. `auto_target_dtype` is the one decision, pure; `read_cpu_flags`
reads the machine (`peagle.target.loader.device_facts` adds the CUDA check, which needs torch), or
`PEAGLE_CPU_FLAGS` when it is set: the flags to decide by instead of the CPU's (`PEAGLE_CPU_FLAGS=avx2` runs
`auto` as an AVX2-only machine does, in float32; docs/testing.md 3).
`hardware_class` names the class of machine (`cpu-bf16`, `cpu-avx512`, `cpu-avx2`, `cpu`, `cuda-<n>gpu`)
the dry-run estimate keeps constants for and matches earlier jobs on (the worker records it on each job).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["CPU_BF16_FLAGS", "CPU_CLASSES", "CPU_FLAGS_ENV", "DeviceFacts", "auto_target_dtype", "cpu_facts", "hardware_class",
           "read_cpu_flags"]

#: The variable that names the CPU flags to decide by instead of /proc/cpuinfo's (comma or space separated).
CPU_FLAGS_ENV = "PEAGLE_CPU_FLAGS"
#: /proc/cpuinfo flags of a CPU that computes in bfloat16 natively (either one is enough).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class DeviceFacts:
    """What `target.dtype: auto` depends on: the CPU's flags and whether the CUDA device has bf16."""

    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cuda_bf16: bool = True


def auto_target_dtype(*, device: str, facts: DeviceFacts) -> Literal["bfloat16", "float32"]:
    """`target.dtype: auto` on `device` (`cpu` or `cuda`): bfloat16 where it runs natively, else float32."""
    if device == "cuda":
        return "bfloat16" if facts.cuda_bf16 else "float32"
    return "bfloat16" if facts.cpu_flags & CPU_BF16_FLAGS else "float32"


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The `flags` of the first processor in `cpuinfo`; empty when there is no such file (not Linux).
    `PEAGLE_CPU_FLAGS` of `environ` (None = `os.environ`), when set and not blank, replaces them."""
    declared = (os.environ if environ is None else environ).get(CPU_FLAGS_ENV, "")
    if declared.strip():
        return frozenset(declared.replace(",", " ").split())
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_facts() -> DeviceFacts:
    """This machine's CPU flags; a CUDA device is assumed to have bf16 (the API cannot ask torch)."""
    return DeviceFacts(cpu_flags=read_cpu_flags())


#: The hardware classes the estimate keeps constants for and matches history on (`hardware_class`).
CPU_CLASSES = ("cpu-bf16", "cpu-avx512", "cpu-avx2", "cpu")


def hardware_class(*, device: str, gpus: int = 0, cpu_flags: frozenset[str] = frozenset()) -> str:
    """The class of machine a job runs on, for estimates: jobs of one class run at comparable speed.

    `cuda-<n>gpu` on CUDA (`gpus` of them, at least 1); on a CPU by its widest native arithmetic:
    `cpu-bf16` (avx512_bf16 or amx_bf16), `cpu-avx512` (avx512f), `cpu-avx2` (avx2), else `cpu`.

        >>> hardware_class(device="cpu", cpu_flags=frozenset({"avx2", "avx512f"}))
        'cpu-avx512'
        >>> hardware_class(device="cuda", gpus=2)
        'cuda-2gpu'
    """
    if device == "cuda":
        return f"cuda-{max(1, gpus)}gpu"
    if cpu_flags & CPU_BF16_FLAGS:
        return "cpu-bf16"
    if "avx512f" in cpu_flags:
        return "cpu-avx512"
    return "cpu-avx2" if "avx2" in cpu_flags else "cpu"
