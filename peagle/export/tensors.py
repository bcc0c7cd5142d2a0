"""`model.safetensors` read as untrusted input: the header checked before any tensor data is read, then
the data in bounded chunks (docs/export.md 5.1, issue 46).

The file is `[u64 little-endian header length n][n bytes of JSON header][data]`; the header maps each
tensor name to `{dtype, shape, data_offsets: [begin, end]}` (offsets into the data) plus an optional
`__metadata__` of strings. `read_safetensors` checks, with a message naming the tensor for each refusal:

- n is within the file and at most `MAX_HEADER_BYTES`; the header is UTF-8 JSON nested at most 3 levels,
  with no NaN, over-long integer or repeated name (`peagle.export.bounds`);
- at most `MAX_TENSORS` tensors, names of at most `MAX_NAME_CHARS` characters; `__metadata__` maps
  strings to strings, `MAX_METADATA_CHARS` in all;
- every dtype is a known one, every shape at most `MAX_RANK` sizes >= 0, and shape product x dtype size ==
  end - begin;
- the ranges tile the data exactly, as the safetensors library requires (it refuses overlaps, holes and
  trailing bytes): each refusal names the tensors.

`all_finite` then reads a tensor `CHUNK_BYTES` at a time (never the whole tensor, never an fp32 copy);
`read_tensor` reads one whole tensor, for the small ones whose size the caller has bounded (d2t, t2d).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.export.bounds import is_int, json_depth, load_json, refused_values

__all__ = ["CHUNK_BYTES", "DTYPE_SIZES", "SafetensorsFile", "TensorInfo", "all_finite", "read_safetensors",
           "read_tensor"]  # fmt: skip

#: safetensors' own limit is 100 MB; a draft's header is ~150 bytes a tensor (a 4-layer draft: ~8 KB).
MAX_HEADER_BYTES = 16 << 20
#: A 256-layer draft (the config limit) has about 3 000 tensors.
MAX_TENSORS = 16_384
#: Real tensor names are under 100 characters ("model.layers.125.mlp.down_proj.weight").
MAX_NAME_CHARS = 512
#: Exports write {"format": "pt"}.
MAX_METADATA_CHARS = 64 << 10
#: A draft's tensors have rank <= 3 (mask_hidden [1, 1, 3H]).
MAX_RANK = 8
#: Bytes read at a time by `all_finite`: a multiple of every dtype size.
CHUNK_BYTES = 16 << 20
#: Dtypes of the safetensors format with whole-byte elements, and their sizes.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}  # fmt: skip
_TORCH_DTYPES = {"BOOL": torch.uint8, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                 "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F32": torch.float32, "F64": torch.float64}  # fmt: skip
# Float dtypes as (int type of their width, exponent mask): all exponent bits set = NaN or an infinity.
# Testing the bits is 2-3x faster than torch.isfinite on bf16, and never converts a value.
_EXPONENT = {"BF16": (torch.int16, 0x7F80), "F16": (torch.int16, 0x7C00), "F32": (torch.int32, 0x7F800000),
             "F64": (torch.int64, 0x7FF0000000000000)}  # fmt: skip
_WHERE = "model.safetensors"
_MAX_PROBLEMS = 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the header: `begin`/`end` are absolute offsets in the file."""

    dtype: str
    shape: list[int]
    begin: int
    end: int


@dataclass
class SafetensorsFile:
    """A checked header: `tensors` by stored name (in header order), `metadata` as given."""

    path: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


class _Unreadable(Exception):
    """The framing or the header JSON is refused: the message says why (no tensor can be trusted)."""


def _header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(parsed header, data start, data length) of a safetensors file.

    Raises:
        _Unreadable: the file, its header length or its header JSON is refused.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _Unreadable(f"the file is {size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise _Unreadable(f"header length {n} runs past the end of the file ({size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise _Unreadable(
                    f"header length {n} is over the limit of {MAX_HEADER_BYTES} bytes (a draft's header is a few KB)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise _Unreadable(f"cannot be read ({exc})") from None
    if len(raw) != n:
        raise _Unreadable(f"the file ended inside its {n}-byte header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"header is not UTF-8 ({exc})") from None
    at = json_depth(raw, 3)
    if at is not None:
        raise _Unreadable(
            f"header is nested deeper than 3 levels at byte {at} (a safetensors header is "
            "{name: {dtype, shape: [...], data_offsets: [...]}})"
        )
    try:
        header = load_json(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise _Unreadable(f"header is not valid JSON ({exc})") from None
    refused = refused_values(header)
    if refused:
        raise _Unreadable("; ".join(f"header {p}" for p in refused))
    if not isinstance(header, dict):
        raise _Unreadable(f"header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n, size - 8 - n


def _metadata_problems(meta: Any) -> list[str]:
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        return [f"{_WHERE}: __metadata__ must map strings to strings (safetensors refuses to load it)"]
    chars = sum(len(k) + len(v) for k, v in meta.items())
    if chars > MAX_METADATA_CHARS:
        return [f"{_WHERE}: __metadata__ holds {chars} characters, over the limit of {MAX_METADATA_CHARS} "
                "(exports write {\"format\": \"pt\"})"]  # fmt: skip
    return []


def _entry(name: str, entry: Any, data_start: int, data_len: int) -> tuple[TensorInfo | None, str | None]:
    """A tensor's header entry checked on its own (dtype, shape, offsets within the data, size)."""
    where = f"{_WHERE}: tensor {name}"
    if not isinstance(entry, dict) or not all(k in entry for k in ("dtype", "shape", "data_offsets")):
        return None, f"{where} must be an object with dtype, shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        shown = repr(dtype)[:40]
        return None, f"{where}: unknown dtype {shown} (safetensors dtypes: {', '.join(DTYPE_SIZES)})"
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(is_int(s) and s >= 0 for s in shape):
        return (
            None,
            f"{where}: shape must be a list of at most {MAX_RANK} integers >= 0, got {repr(shape)[:60]}",
        )
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):  # fmt: skip
        return (
            None,
            f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {repr(offsets)[:60]}",
        )
    begin, end = offsets
    if end > data_len:
        return None, (f"{where}: data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes; "
                      "the file is truncated?)")  # fmt: skip
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: a huge shape is multiplied, never allocated
    if nbytes != end - begin:
        return None, (f"{where}: shape {shape} of {dtype} is {nbytes} bytes, but its data_offsets [{begin}, {end}] "
                      f"span {end - begin}")  # fmt: skip
    return TensorInfo(dtype=dtype, shape=list(shape), begin=data_start + begin, end=data_start + end), None


def _tiling_problems(tensors: dict[str, TensorInfo], data_start: int, data_len: int) -> list[str]:
    """Overlaps, holes and trailing bytes of the data region (safetensors refuses each)."""
    out: list[str] = []
    at, prev = data_start, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        span = f"{name} [{t.begin - data_start}, {t.end - data_start})"
        if t.begin < at:
            out.append(f"{_WHERE}: tensors {prev} and {span} overlap (safetensors refuses overlapping data)")
        elif t.begin > at:
            after = f"tensors {prev} and {span}" if prev else f"the data start and tensor {span}"
            out.append(
                f"{_WHERE}: {t.begin - at} bytes between {after} hold no tensor (safetensors refuses holes)"
            )
        if t.end >= at:
            at, prev = t.end, span
    if at < data_start + data_len:
        out.append(f"{_WHERE}: {data_start + data_len - at} bytes after the last tensor are not in the header "
                   "(safetensors refuses to load the file)")  # fmt: skip
    return out


def read_safetensors(path: str | Path) -> tuple[SafetensorsFile | None, list[str]]:
    """The checked header of a safetensors file, or None and every problem found (at most 20 + a count).

    Reads only the 8-byte length and the header, never tensor data.
    """
    path = Path(path)
    try:
        header, data_start, data_len = _header(path)
    except _Unreadable as exc:
        return None, [f"{_WHERE}: {exc}"]
    meta = header.pop("__metadata__", {})
    problems = _metadata_problems(meta)
    if len(header) > MAX_TENSORS:
        problems.append(f"{_WHERE}: {len(header)} tensors, over the limit of {MAX_TENSORS} (a 256-layer draft "
                        "has about 3000)")  # fmt: skip
        return None, problems
    out = SafetensorsFile(path=path, metadata=meta if not problems else {})
    for name, entry in header.items():
        if len(name) > MAX_NAME_CHARS:
            problems.append(f"{_WHERE}: a tensor name of {len(name)} characters ({name[:40]!r}...), over the limit "
                            f"of {MAX_NAME_CHARS}")  # fmt: skip
            continue
        info, problem = _entry(name, entry, data_start, data_len)
        if problem:
            problems.append(problem)
        elif info is not None:
            out.tensors[name] = info
    if not problems:
        problems = _tiling_problems(out.tensors, data_start, data_len)
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        return None, problems[:_MAX_PROBLEMS] + (
            [f"{_WHERE}: ... and {more} more problems"] if more > 0 else []
        )
    return out, []


def _read_into(f: io.BufferedReader, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError("the file ended early (changed while it was read?)")
        got += n


def all_finite(sf: SafetensorsFile, names: list[str]) -> list[str]:
    """The float tensors among `names` that hold a NaN or an infinity.

    Reads each `CHUNK_BYTES` at a time into one reused buffer and tests the exponent bits of each value.

    Raises:
        OSError: the file cannot be read (or shrank since its header was read).
    """
    buf = bytearray(CHUNK_BYTES)
    bad: list[str] = []
    with sf.path.open("rb") as f:
        for name in names:
            t = sf.tensors[name]
            if t.dtype not in _EXPONENT:
                continue
            bits, mask = _EXPONENT[t.dtype]
            f.seek(t.begin)
            left = t.end - t.begin
            while left:
                n = min(left, len(buf))
                _read_into(f, memoryview(buf)[:n])
                x = torch.frombuffer(
                    buf, dtype=bits, count=n // DTYPE_SIZES[t.dtype]
                )  # [chunk] a view of buf
                if bool((x & mask).eq(mask).any()):
                    bad.append(name)
                    break
                left -= n
    return bad


def read_tensor(sf: SafetensorsFile, name: str) -> torch.Tensor:
    """One whole tensor (BOOL as torch.bool); for small tensors whose size the caller has bounded.

    Raises:
        OSError: the file cannot be read.
        KeyError: a dtype torch has no type for here (only d2t / t2d dtypes are read).
    """
    t = sf.tensors[name]
    dtype = _TORCH_DTYPES[t.dtype]
    if t.end == t.begin:
        return torch.empty(t.shape, dtype=torch.bool if t.dtype == "BOOL" else dtype)
    buf = bytearray(t.end - t.begin)
    with sf.path.open("rb") as f:
        f.seek(t.begin)
        _read_into(f, memoryview(buf))
    x = torch.frombuffer(buf, dtype=dtype).reshape(t.shape)
    return x.ne(0) if t.dtype == "BOOL" else x
