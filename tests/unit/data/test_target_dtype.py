"""`target.dtype: auto` follows what the hardware runs natively (issue 39).

On a 2-core AMD EPYC with AVX2 only, the demo's bfloat16 target made vLLM generate 19-26 tokens/s: bf16 is
emulated there. `auto` is bfloat16 only on a CUDA GPU with bf16 or a CPU with avx512_bf16 / amx_bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle.spec import parse_spec, preset
from peagle.spec.hardware import DeviceFacts, auto_target_dtype, read_cpu_flags
from peagle.target.loader import device_facts, resolve_dtype

# /proc/cpuinfo flags (abridged) of the reporting user's AMD EPYC and of a Sapphire Rapids Xeon
EPYC_AVX2 = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2",
                       "sha_ni"})
AVX512_NO_BF16 = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
XEON_BF16 = AVX512_NO_BF16 | {"avx512_bf16"}
AMX = EPYC_AVX2 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(("device", "flags", "cuda_bf16", "want"), [
    ("cpu", EPYC_AVX2, True, "float32"),
    ("cpu", AVX512_NO_BF16, True, "float32"),
    ("cpu", XEON_BF16, False, "bfloat16"),
    ("cpu", AMX, False, "bfloat16"),
    ("cpu", frozenset(), True, "float32"),
    ("cuda", EPYC_AVX2, True, "bfloat16"),
    ("cuda", XEON_BF16, False, "float32"),  # a GPU without bf16 (pre-Ampere): the CPU's flags do not matter
])
def test_auto_target_dtype_over_flag_sets(device: str, flags: frozenset[str], cuda_bf16: bool, want: str) -> None:
    assert auto_target_dtype(device=device, facts=DeviceFacts(cpu_flags=flags, cuda_bf16=cuda_bf16)) == want


def test_read_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\nbugs\t\t: sysret_ss_attrs\n"
                    "\nprocessor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert read_cpu_flags(info, environ={}) == {"fpu", "avx2", "fma"}
    assert read_cpu_flags(tmp_path / "missing", environ={}) == frozenset()


def test_declared_cpu_flags_replace_the_machines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PEAGLE_CPU_FLAGS` (docs/testing.md 3): the suite runs `auto` as an AVX2-only machine does, on any CPU."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert read_cpu_flags(info, environ={"PEAGLE_CPU_FLAGS": "avx2, fma"}) == {"avx2", "fma"}
    assert read_cpu_flags(info, environ={"PEAGLE_CPU_FLAGS": "  "}) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    monkeypatch.setenv("PEAGLE_CPU_FLAGS", "avx2")
    spec = parse_spec({"target": {"model": "builtin:tiny-llama"}})
    assert resolve_dtype(spec, torch.device("cpu")) == torch.float32  # whatever this machine has
    from peagle.engine.environment import child_env

    assert child_env()["PEAGLE_CPU_FLAGS"] == "avx2"  # the trainer and the engines decide alike


@pytest.mark.parametrize("name", ["demo", "gpu-llama3-8b", "gpu-qwen3-8b"])
def test_presets_leave_the_target_dtype_to_the_hardware(name: str) -> None:
    assert preset(name).target.dtype == "auto"


@pytest.mark.parametrize(("flags", "want"), [(EPYC_AVX2, "float32"), (XEON_BF16, "bfloat16"), (AMX, "bfloat16")])
def test_the_demo_resolves_its_dtype_per_machine(flags: frozenset[str], want: str) -> None:
    resolved = preset("demo").resolve(cuda_available=False, device_facts=DeviceFacts(cpu_flags=flags))
    assert resolved.target.dtype == want


def test_an_explicit_dtype_is_kept_whatever_the_machine() -> None:
    spec = parse_spec({"target": {"model": "builtin:tiny-llama", "dtype": "bfloat16"}})
    assert spec.resolve(cuda_available=False, device_facts=DeviceFacts(cpu_flags=EPYC_AVX2)).target.dtype == "bfloat16"


def test_the_loader_resolves_auto_from_this_machine() -> None:
    spec = parse_spec({"target": {"model": "builtin:tiny-llama"}})
    cpu = torch.device("cpu")
    native = bool(read_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert device_facts(cpu).cpu_flags == read_cpu_flags()
    assert resolve_dtype(spec, cpu) == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize(("flags", "want"), [(EPYC_AVX2, "float32"), (XEON_BF16, "bfloat16")])
def test_the_dry_run_shows_the_resolved_dtype(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str],
                                              want: str) -> None:
    from api.checkpoint_schemas import Estimate
    from service.estimate import dry_run

    monkeypatch.setattr(dry_run, "cpu_facts", lambda: DeviceFacts(cpu_flags=flags))
    est = dry_run.estimate(preset("demo"), dataset_rows={}, queue="cpu", queue_position=0)
    assert est["target_dtype"] == want
    assert Estimate.model_fields["target_dtype"].annotation is not None
