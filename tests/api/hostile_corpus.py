"""The hostile corpus: uploads an attacker would send, made from one valid export (issue 46).

    python -m tests.api.hostile_corpus --export path/to/valid-export OUT    # writes OUT/<case>.<ext> + index.json

Each case is a draft archive or a dataset file with what the service must say about it: `expect`, a
regular expression the refusal's text must match (the upload's report or the error message), so a
refusal for the wrong reason fails too. `tests/api/test_hostile_corpus.py` sends every case to a real
API process. The cases, by family:

- config values a validator would size memory from: 10^9 layers, 10^12 vocabulary, NaN, negative
  sizes, a string for a number, 100,000 nested lists (deep JSON), a 9 MB config;
- crafted safetensors: a header length past the end of the file, a header length of 2^63, a header
  that is not JSON, overlapping tensor ranges, a shape that does not match its byte range, an unknown
  dtype, a range past the end of the file;
- archives: a bomb of 1 GiB of zeros (ratio about 1000:1) past the owner's quota, path traversal, a symlink,
  more entries than an export can have;
- a host folder named by the upload (`verifier.name_or_path: /etc`): answered exactly like a
  folder that does not exist;
- datasets: deep JSON rows, binary garbage, an over-long row, an empty file.
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Case", "cases", "write_corpus"]


@dataclass(frozen=True)
class Case:
    """One hostile upload: `kind` is `draft` or `dataset`; `expect` a regex of the refusal's reason."""

    name: str
    kind: str
    filename: str
    data: bytes
    expect: str


def _tar(files: dict[str, bytes], *, top: str = "draft") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _safetensors(header: dict[str, object] | bytes, data: bytes, *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _split_safetensors(blob: bytes) -> tuple[dict[str, dict[str, object]], bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _config_cases(config: dict[str, object], weights: bytes) -> Iterator[Case]:
    def with_config(name: str, edit: Callable[[dict[str, object]], None], expect: str) -> Case:
        cfg = json.loads(json.dumps(config))
        edit(cfg)
        return Case(name, "draft", f"{name}.tar.gz",
                    _tar({"config.json": json.dumps(cfg).encode(), "model.safetensors": weights}), expect)

    def put(key: str, value: object) -> Callable[[dict[str, object]], None]:
        return lambda c: c.__setitem__(key, value)

    yield with_config("layers_1e9", put("num_hidden_layers", 10**9), r"num_hidden_layers")
    yield with_config("vocab_1e12", put("vocab_size", 10**12), r"vocab_size")
    yield with_config("hidden_nan", put("hidden_size", float("nan")), r"hidden_size")
    yield with_config("hidden_negative", put("hidden_size", -64), r"hidden_size")
    yield with_config("layers_string", put("num_hidden_layers", "1e9"), r"num_hidden_layers")
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    yield Case("config_deep_json", "draft", "config_deep_json.tar.gz",
               _tar({"config.json": b'{"a": ' + deep + b"}", "model.safetensors": weights}),
               r"config\.json.*(deep|nest)")
    big = json.dumps({**config, "padding": "x" * (9 << 20)}).encode()
    yield Case("config_9mb", "draft", "config_9mb.tar.gz",
               _tar({"config.json": big, "model.safetensors": weights}), r"config\.json.*(large|bytes|MB|MiB)")


def _safetensors_cases(config: dict[str, object], weights: bytes) -> Iterator[Case]:
    header, data = _split_safetensors(weights)
    cfg = json.dumps(config).encode()
    tensors = [k for k in header if k != "__metadata__"]
    first, second = tensors[0], tensors[1]

    def case(name: str, blob: bytes, expect: str) -> Case:
        return Case(name, "draft", f"{name}.tar.gz", _tar({"config.json": cfg, "model.safetensors": blob}), expect)

    yield case("st_header_past_end", _safetensors(header, data, length=len(weights) * 4), r"model\.safetensors")
    yield case("st_header_2_63", _safetensors(header, data, length=2**63), r"model\.safetensors")
    yield case("st_header_not_json", _safetensors(b"{not json" + b" " * 64, data), r"model\.safetensors")
    overlap = json.loads(json.dumps(header))
    overlap[second]["data_offsets"] = overlap[first]["data_offsets"]
    yield case("st_overlap", _safetensors(overlap, data), r"(overlap|offset)")
    shape = json.loads(json.dumps(header))
    shape[first]["shape"] = [10**6, 10**6]
    yield case("st_shape_mismatch", _safetensors(shape, data), re_escape_any(first))
    dtype = json.loads(json.dumps(header))
    dtype[first]["dtype"] = "Q7"
    yield case("st_unknown_dtype", _safetensors(dtype, data), r"(dtype|Q7)")
    past = json.loads(json.dumps(header))
    start, _end = past[first]["data_offsets"]
    past[first]["data_offsets"] = [start, len(data) + 10**9]
    yield case("st_range_past_end", _safetensors(past, data), r"(offset|range|end|size)")


def re_escape_any(name: str) -> str:
    """A regex that matches the tensor `name` (dots escaped)."""
    return name.replace(".", r"\.")


def _archive_cases(config: dict[str, object], weights: bytes) -> Iterator[Case]:
    cfg = json.dumps(config).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("draft/config.json", cfg)
        z.writestr("draft/model.safetensors", weights)
        with z.open("draft/padding.bin", "w", force_zip64=True) as f:  # 1 GiB of zeros, about 1 MB packed
            chunk = bytes(1 << 20)
            for _ in range(1024):
                f.write(chunk)
    yield Case("bomb_zeros_1gib", "draft", "bomb_zeros_1gib.zip", buf.getvalue(), r"(quota|limit|large|bytes)")
    traversal = io.BytesIO()
    with tarfile.open(fileobj=traversal, mode="w:gz") as tar:
        for name, data in (("draft/config.json", cfg), ("draft/model.safetensors", weights),
                           ("draft/../../../../tmp/peagle-hostile-escape", b"escaped")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    yield Case("tar_traversal", "draft", "tar_traversal.tar.gz", traversal.getvalue(), r"\.\.")
    link = io.BytesIO()
    with tarfile.open(fileobj=link, mode="w:gz") as tar:
        info = tarfile.TarInfo("draft/config.json")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    yield Case("tar_symlink", "draft", "tar_symlink.tar.gz", link.getvalue(), r"link")
    many = {f"f{i}.txt": b"x" for i in range(5000)}
    yield Case("tar_many_entries", "draft", "tar_many_entries.tar.gz", _tar(many), r"entries")


def _host_path_cases(config: dict[str, object], weights: bytes) -> Iterator[Case]:
    for name, where in (("verifier_host_folder", "/etc"), ("verifier_missing_folder", "/no/such/peagle/folder")):
        cfg = json.loads(json.dumps(config))
        cfg["speculators_config"]["verifier"]["name_or_path"] = where  # type: ignore[index]
        yield Case(name, "draft", f"{name}.tar.gz",
                   _tar({"config.json": json.dumps(cfg).encode(), "model.safetensors": weights}), r".")


def _dataset_cases() -> Iterator[Case]:
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    good = json.dumps(row).encode() + b"\n"
    yield Case("rows_deep_json", "dataset", "rows_deep_json.jsonl",
               good + b'{"conversations": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", r"too_deep")
    yield Case("rows_binary", "dataset", "rows_binary.jsonl", bytes(range(256)) * 64, r"no usable row")
    # the over-long row is the last line, with no newline after it (it used to be dropped unseen)
    yield Case("row_too_long", "dataset", "row_too_long.jsonl",
               good + json.dumps({"conversations": [{"from": "human", "value": "x" * (33 << 20)}]}).encode(),
               r"line 2: row exceeds the limit")
    yield Case("empty_file", "dataset", "empty_file.jsonl", b"", r"empty file")


def cases(export: Path) -> list[Case]:
    """Every hostile case, made from the valid export folder `export` (config.json + model.safetensors)."""
    config = json.loads((export / "config.json").read_text())
    weights = (export / "model.safetensors").read_bytes()
    return [*_config_cases(config, weights), *_safetensors_cases(config, weights), *_archive_cases(config, weights),
            *_host_path_cases(config, weights), *_dataset_cases()]


def write_corpus(export: Path, out: Path) -> list[Case]:
    """Write every case to `out/<filename>` and `out/index.json` (name, kind, filename, expect)."""
    out.mkdir(parents=True, exist_ok=True)
    made = cases(export)
    for c in made:
        (out / c.filename).write_bytes(c.data)
    (out / "index.json").write_text(json.dumps([{k: v for k, v in asdict(c).items() if k != "data"} for c in made],
                                               indent=1))
    return made


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="a valid export folder to start from")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    made = write_corpus(args.export, args.out)
    print(f"{len(made)} cases in {args.out}")


if __name__ == "__main__":
    main()
