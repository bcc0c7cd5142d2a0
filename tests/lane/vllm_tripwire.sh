#!/bin/sh
# The fast lane's vLLM interpreter (tests/conftest.py): a test that starts vLLM there is a heavy test that
# is not marked so. Mark it `slow` (pyproject's markers) and it runs in `make test` only.
echo "vLLM was started in the fast lane (PEAGLE_TEST_LANE=fast): mark this test slow; make test runs it" >&2
exit 3
