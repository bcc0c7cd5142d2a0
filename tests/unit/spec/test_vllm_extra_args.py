"""`resources.vllm.extra_args` is read as `vllm serve`'s argparse reads it, or refused where that is ambiguous.

The bypasses: an empty inline value (`--quantization=`) made the checker take the next element as the
value while argparse takes it as the next argument, so a forbidden switch (`--trust-remote-code`,
`--enable-prefix-caching`) or a positional (`..`) reached vLLM.
"""

from __future__ import annotations

import pytest

from peagle.spec import SpecInvalidError, parse_spec

BASE = {"target": {"model": "org/model"}}


def problems(extra_args: list[str]) -> list[tuple[str, str]]:
    """(field path, message) of every problem of a spec with these extra_args, in order."""
    try:
        parse_spec({**BASE, "resources": {"vllm": {"extra_args": extra_args}}})
    except SpecInvalidError as exc:
        return [(p.path, p.message) for p in exc.problems]
    return []


@pytest.mark.parametrize("smuggled", ["--trust-remote-code", "--enable-prefix-caching", ".."])
def test_an_empty_inline_value_does_not_swallow_the_next_argument(smuggled: str) -> None:
    got = problems(["--quantization=", smuggled])
    paths = [p for p, _m in got]
    assert "resources.vllm.extra_args.0" in paths, got
    assert "resources.vllm.extra_args.1" in paths, got  # the smuggled argument is judged as what vLLM sees
    assert any("empty value" in m for p, m in got if p == "resources.vllm.extra_args.0"), got


def test_a_switch_with_an_empty_inline_value_is_refused() -> None:
    got = problems(["--enforce-eager="])
    assert got and got[0][0] == "resources.vllm.extra_args.0" and "switch" in got[0][1], got


@pytest.mark.parametrize("value", ["--trust-remote-code", "-1", "--enable-prefix-caching"])
def test_a_value_that_starts_with_a_dash_is_refused(value: str) -> None:
    got = problems(["--quantization", value])
    assert ("resources.vllm.extra_args.1", f"--quantization needs a value, got the flag-like {value!r}") in got, got


@pytest.mark.parametrize("args", [["64"], ["--max-num-seqs", "64", "extra"], [".."], ["model-name"]])
def test_a_positional_where_a_flag_is_expected_is_refused(args: list[str]) -> None:
    got = problems(args)
    where = f"resources.vllm.extra_args.{len(args) - 1}"
    assert any(p == where and "expected a flag" in m for p, m in got), got


def test_a_word_value_starts_with_a_letter_or_digit() -> None:
    got = problems(["--kv-cache-dtype", ".."])
    assert any(p == "resources.vllm.extra_args.1" and "takes a word" in m for p, m in got), got
    got = problems(["--quantization=.."])
    assert any(p == "resources.vllm.extra_args.0" and "takes a word" in m for p, m in got), got


def test_a_repeated_flag_is_refused() -> None:
    got = problems(["--max-num-seqs", "8", "--max-num-seqs=64"])
    assert ("resources.vllm.extra_args.2", "--max-num-seqs is given twice (first at extra_args[0])") in got, got
    got = problems(["--enforce-eager", "--enforce-eager"])
    assert any(p == "resources.vllm.extra_args.1" and "given twice" in m for p, m in got), got


def test_well_formed_arguments_still_pass() -> None:
    assert problems(["--max-num-seqs", "64", "--enforce-eager", "--kv-cache-dtype=fp8", "--quantization",
                     "awq_marlin", "--swap-space=4.5", "--seed", "0"]) == []


#: Parses `vllm serve --model MODEL *args` (as `peagle.engine.server` starts it) with vLLM's own parser (in its
#: venv) and prints what it read, one line per argument list.
_VLLM_READS = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
for args in json.loads(sys.argv[1]):
    ns = parser.parse_args(["--model", "served-model", *args])
    print(json.dumps({"trust_remote_code": ns.trust_remote_code, "enable_prefix_caching": ns.enable_prefix_caching,
                      "model_tag": ns.model_tag, "quantization": ns.quantization, "max_num_seqs": ns.max_num_seqs}))
"""


@pytest.mark.slow
def test_what_vllm_itself_reads_from_the_bypasses_and_from_accepted_arguments() -> None:
    """The real `vllm serve` parser: each bypass turns on what the allow-list forbids (so the refusal matters),
    and an accepted list reads as the checker reads it."""
    import json
    import subprocess

    from peagle.engine.locate import vllm_python

    py = vllm_python()
    if py is None:
        pytest.skip("vLLM venv missing: run `make vllm-env`")
    cases = [["--quantization=", "--trust-remote-code"], ["--quantization=", "--enable-prefix-caching"],
             ["--quantization=", ".."], ["--max-num-seqs", "64", "--quantization=fp8", "--enforce-eager"]]
    out = subprocess.run([str(py), "-c", _VLLM_READS, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300, check=True)
    trust, prefix, positional, accepted = (json.loads(line) for line in out.stdout.splitlines()[-4:])
    assert trust["trust_remote_code"] is True and trust["quantization"] is None
    assert prefix["enable_prefix_caching"] is True
    assert positional["model_tag"] == ".."  # `vllm serve` serves the positional model tag instead of --model
    assert all(problems(args) for args in cases[:3])
    assert problems(cases[3]) == [] and (accepted["max_num_seqs"], accepted["quantization"]) == (64, "fp8")
