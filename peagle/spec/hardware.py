"""What the machine runs natively, as the facts `target.dtype: auto` is resolved from (torch-free).

    facts = DeviceFacts(cpu_flags=read_cpu_flags(), cuda_bf16=True)
    auto_target_dtype(device="cpu", facts=facts)     # "bfloat16" on a CPU with avx512_bf16 or amx_bf16

bfloat16 runs natively on a CUDA GPU that supports it (Ampere and later) and on a CPU with AVX512-BF16 or
AMX-BF16; elsewhere (an AVX2-only CPU) it is emulated and vLLM generated 19-26 tokens/s where fp32 is several
times faster, so `auto` is float32 there. `auto_target_dtype` is the one decision, pure; `read_cpu_flags`
reads the machine (`peagle.target.loader.device_facts` adds the CUDA check, which needs torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["CPU_BF16_FLAGS", "DeviceFacts", "auto_target_dtype", "cpu_facts", "read_cpu_flags"]

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


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The `flags` of the first processor in `cpuinfo`; empty when there is no such file (not Linux)."""
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
