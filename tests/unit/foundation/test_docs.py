"""Every reference to a document, a file or a module in the repository resolves.

Scans the project's own .py/.js/.html/.md/.sh files (not virtualenvs, caches or vendored code) for:

* `docs/<name>.md` citations, optionally with section numbers (`docs/algorithm.md 1.12`,
  `docs/export.md 2.1`, `docs/algorithm.md 4.1-4.3`) or decision numbers (`docs/decisions.md decision 9`,
  `decisions 5 and 9`): the file must exist and hold a heading with that number;
* any other `<name>.md`: the file must exist (relative to the citing file, the repo root or `docs/`);
* repo-relative paths such as `peagle/cod/rows.py` or `service/db/lease.py`: the file must exist;
* dotted references to project modules such as `peagle.cod.rows.plan_segments`: the module must exist
  and name what follows;
* bare `decision N` (without `docs/decisions.md`) and bare `section N` outside `docs/`.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
THIS = Path(__file__).resolve()

SUFFIXES = {".py", ".js", ".html", ".md", ".sh"}
SKIP_DIRS = {"__pycache__", "node_modules", "vendor", "runs", "test-artifacts", "results"}
# Documents that live outside the repository and must never be cited (names built so this file is clean).
FORBIDDEN = tuple(n + ".md" for n in ("peagle", "common", "data_api", "service_contract", "environment", "style"))
PACKAGES = ("peagle", "service", "api", "worker", "bench", "tests", "frontend", "migrations", "docs")

URL = re.compile(r"https?://[^\s)>\"'`]+")
NUM = r"\d+(?:\.\d+)*"
DOC_CITE = re.compile(rf"docs/(\w+)\.md(?: ({NUM}(?:(?:, | and |-|/){NUM})*))?")
DECISION_CITE = re.compile(r"docs/decisions\.md decisions? (\d+(?:(?:, | and )\d+)*)")
BARE_DECISION = re.compile(r"(?<!docs/decisions\.md )\bdecisions? \d")
BARE_SECTION = re.compile(r"\bsections? \d")
MD_NAME = re.compile(r"(?<![\w/.-])([\w./-]*\w\.md)\b")
REPO_PATH = re.compile(
    rf"(?<![\w./{{-])((?:{'|'.join(PACKAGES)})/[\w./-]*\.(?:py|js|html|md|sh|css|toml))(?![\w{{*])"
)
DOTTED = re.compile(r"`((?:peagle|service|api|worker)(?:\.\w+)+)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
DECISION_HEADING = re.compile(r"^#{1,6}\s+Decision (\d+)\b", re.M)


def _files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                       and not d.endswith(".egg-info")]
        out += [Path(dirpath) / f for f in filenames if Path(f).suffix in SUFFIXES]
    return sorted(p for p in out if p != THIS)  # this file holds bad examples on purpose


@cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@cache
def _sections(doc: Path) -> frozenset[str]:
    return frozenset(HEADING.findall(_text(doc)))


@cache
def _decisions() -> frozenset[str]:
    return frozenset(DECISION_HEADING.findall(_text(DOCS / "decisions.md")))


def _numbers(group: str | None) -> list[str]:
    """The numbers of a citation ("1.7 and 1.12", "4.1-4.3", "4-5"); a continuation must have the first
    number's shape, so "1.12, 28%" is one section followed by prose."""
    nums = re.findall(NUM, group or "")
    out = nums[:1]
    for n in nums[1:]:
        if ("." in n) != ("." in nums[0]):
            break
        out.append(n)
    return out


def _md_exists(name: str, source: Path) -> bool:
    bases = [source.parent, ROOT] if "/" in name else [source.parent, ROOT, DOCS]
    return any((base / name).is_file() for base in bases)


def _module_names(dotted: str) -> str | None:
    """Why a dotted project reference does not resolve, or None when it does (or is no module path)."""
    parts = dotted.split(".")
    path = ROOT / parts[0]
    i = 1
    while i < len(parts) and ((path / parts[i]).is_dir() or (path / f"{parts[i]}.py").is_file()):
        path = path / parts[i]
        i += 1
    if i == 1:
        return None  # e.g. a spec field path (`peagle.num_depths`), not a module reference
    if i == len(parts):
        return None
    module = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if path.is_dir() and not module.is_file():
        return f"{dotted}: package {path.relative_to(ROOT)} has no {parts[i]!r}"
    if not re.search(rf"\b{re.escape(parts[i])}\b", _text(module)):
        return f"{dotted}: {module.relative_to(ROOT)} does not name {parts[i]!r}"
    return None


def _problems(path: Path, text: str) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    in_docs = rel.startswith("docs/")
    text = URL.sub("", text)
    bad: list[str] = []

    def report(pos: int, message: str) -> None:
        bad.append(f"{rel}:{text.count(chr(10), 0, pos) + 1}: {message}")

    for m in re.finditer("|".join(re.escape(n) for n in FORBIDDEN), text):
        report(m.start(), f"cites {m.group()}, a document outside the repository (use docs/)")
    for m in DOC_CITE.finditer(text):
        doc = DOCS / f"{m.group(1)}.md"
        if not doc.is_file():
            report(m.start(), f"{m.group()}: no such document")
            continue
        missing = [n for n in _numbers(m.group(2)) if n not in _sections(doc)]
        if missing:
            report(m.start(), f"{m.group()}: docs/{doc.name} has no section {', '.join(missing)}")
    for m in DECISION_CITE.finditer(text):
        missing = [n for n in _numbers(m.group(1)) if n not in _decisions()]
        if missing:
            report(m.start(), f"{m.group()}: docs/decisions.md has no decision {', '.join(missing)}")
    for m in BARE_DECISION.finditer(text):
        report(m.start(), f"{m.group()!r}: write 'docs/decisions.md decision N'")
    for m in BARE_SECTION.finditer(text):
        if not in_docs:
            report(m.start(), f"{m.group()!r}: cite 'docs/<file>.md N.M' instead")
            continue
        missing = [n for n in _numbers(text[m.end() - 1 : m.end() + 12].split()[0]) if n not in _sections(path)]
        if missing:
            report(m.start(), f"{m.group()}: this document has no section {', '.join(missing)}")
    for m in MD_NAME.finditer(text):
        if not _md_exists(m.group(1), path):
            report(m.start(), f"{m.group(1)}: no such file")
    for m in REPO_PATH.finditer(text):
        if not (ROOT / m.group(1)).exists():
            report(m.start(), f"{m.group(1)}: no such file")
    for m in DOTTED.finditer(text):
        why = _module_names(m.group(1))
        if why:
            report(m.start(), why)
    return bad


def test_docs_folder_has_the_cited_documents() -> None:
    for name in ("README", "decisions", "algorithm", "export", "service", "progress", "experiments", "spec"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    assert {str(n) for n in range(1, 13)} <= _decisions()
    assert {f"1.{n}" for n in range(1, 16)} <= _sections(DOCS / "algorithm.md")


def test_every_reference_resolves() -> None:
    bad = [p for f in _files() for p in _problems(f, _text(f))]
    assert not bad, "dangling references:\n" + "\n".join(bad)


def test_the_checker_catches_bad_references(tmp_path: Path) -> None:
    src = ROOT / "peagle" / "example.py"  # a pretend location; nothing is written there
    text = "\n".join([
        "see docs/algorithm.md 9.99 and docs/nowhere.md",
        "docs/decisions.md decision 99, docs/export.md 2.1",
        "(" + "peagle" + ".md 1.7), " + "common" + ".md",
        "peagle/no_such_module.py and `peagle.cod.rows.no_such_name`",
        "as in decision 3, see section 1.7",
    ])
    found = "\n".join(_problems(src, text))
    for needle in ("9.99", "nowhere.md", "decision 99", "peagle" + ".md", "common" + ".md",
                   "no_such_module.py", "no_such_name", "'decision 3'", "'section 1'"):
        assert needle in found, (needle, found)
    assert "2.1" not in found


ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
EXPERIMENT_LINK = re.compile(r"experiments\.md#([\w-]+)")


def _experiment_links(text: str) -> list[str]:
    return EXPERIMENT_LINK.findall(text)


def test_every_experiment_link_resolves() -> None:
    anchors = set(ANCHOR.findall(_text(DOCS / "experiments.md")))
    for path in _files():
        if path.suffix != ".md":
            continue
        for target in _experiment_links(_text(path)):
            assert target in anchors, f"{path.relative_to(ROOT)}: experiments.md#{target} has no anchor"


def test_every_experiment_is_linked_from_the_decision_it_decided() -> None:
    """Experiment `eN` decided docs/decisions.md decision N, whose section links it; the observations
    `service-N` are behind docs/service.md N, whose section links them."""
    decisions = _text(DOCS / "decisions.md")
    sections = dict(re.findall(r"(?ms)^## Decision (\d+)\b(.*?)(?=^## |\Z)", decisions))
    service = dict(re.findall(r"(?ms)^## (\d+)\.(.*?)(?=^## |\Z)", _text(DOCS / "service.md")))
    anchors = ANCHOR.findall(_text(DOCS / "experiments.md"))
    assert anchors
    for anchor in anchors:
        number = re.fullmatch(r"e(\d+)", anchor)
        if number is None and (observed := re.fullmatch(r"service-(\d+)", anchor)):
            assert observed.group(1) in service, f"{anchor}: docs/service.md has no section {observed.group(1)}"
            assert f"experiments.md#{anchor}" in service[observed.group(1)], f"its section does not link {anchor}"
            continue
        assert number, f"experiment anchor {anchor!r} is not e<decision number> or service-<section number>"
        assert number.group(1) in sections, f"{anchor}: no such decision"
        assert f"experiments.md#{anchor}" in sections[number.group(1)], f"its decision does not link {anchor}"


def test_docs_index_lists_every_document() -> None:
    index = _text(DOCS / "README.md")
    for doc in sorted(DOCS.glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not index {doc.name}"
    assert "](../bench/README.md)" in index, "docs/README.md does not index bench/README.md"


def test_service_doc_states_what_the_import_contracts_enforce() -> None:
    """docs/service.md 1 names every module each import-linter contract forbids, and their number."""
    import tomllib

    contracts = tomllib.loads(_text(ROOT / "pyproject.toml"))["tool"]["importlinter"]["contracts"]
    text = _text(DOCS / "service.md")
    section = text[text.index("## 1.") : text.index("## 2.")]
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven",
             12: "twelve"}
    assert f"the {words.get(len(contracts), str(len(contracts)))} import-linter contracts" in section
    for contract in contracts:
        for module in contract.get("forbidden_modules", []):
            name = module.split(".", 1)[1] if module.startswith("peagle.") else module
            assert f"`{name}`" in section or name.lower() in section.lower(), (contract["name"], module)


VARIANT_ARG = re.compile(r"--(?:variants|peer-of) ([a-z][\w.-]*(?:,[a-z][\w.-]*)*)")


def test_documented_bench_method_variants_exist() -> None:
    """Every `--variants a,b` / `--peer-of a` a document tells you to run names a variant of bench_method."""
    source = _text(ROOT / "bench" / "bench_method.py")
    names = set(re.findall(r'^    "([\w.-]+)": \(', source, re.M))
    assert {"baseline", "peer", "demo_all_positions", "l2_layer_lr_3"} <= names
    for path in (ROOT / "README.md", ROOT / "bench" / "README.md", DOCS / "experiments.md", DOCS / "decisions.md"):
        for match in VARIANT_ARG.finditer(_text(path)):
            unknown = [v for v in match.group(1).split(",") if v not in names]
            assert not unknown, f"{path.relative_to(ROOT)}: {match.group()} names no variant {unknown}"
