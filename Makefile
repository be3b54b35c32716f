# vlguard developer entry points. The virtual environment is built on demand by scripts/venv.sh in
# $(VLGUARD_CACHE) (outside the clone), keyed by a hash of the requirement files, and reused.
VLLM ?= 0.20.0
HOST ?= 127.0.0.1
PORT ?= 8000
PROFILE ?= config/tiny-cpu.yaml
export VLGUARD_CACHE ?= $(HOME)/.cache/vlguard
# MODEL: the model to serve or bench; empty: the embedded tiny model, built once in $(VLGUARD_CACHE).
MODEL ?=
# Shell prefix of the serve/bench recipes: $$PY (the lane's Python) and $$model (MODEL or the tiny model).
WITH_MODEL = PY=$$(scripts/venv.sh $(VLLM)) && model="$(MODEL)" && model="$${model:-$$($$PY -m server tiny-model)}"
SERVE_ARGS ?=
PYTEST_ARGS ?=
# full: every test. lane: the focused suite each engine lane runs (tests marked `lane` but not `full_only`;
# every unit and in-process API test is marked `lane`). front: the unit and in-process API tests alone (no
# engine), for a front lane, whose vLLM has no CPU build (0.34.0).
SUITE ?= full
# LINT=no skips lint in `make test` (CI lints once, on the default lane).
LINT ?= yes

SCENARIO ?= overhead
BENCH_ARGS ?=

.PHONY: venv serve serve-stock tiny-model tools lint test bench
.DEFAULT_GOAL := test

venv:  ## create or reuse the environment; prints its Python as the last line
	@scripts/venv.sh $(VLLM)

tiny-model:  ## build the embedded tiny Qwen3-VL into the cache (once); prints its directory
	@PY=$$(scripts/venv.sh $(VLLM)) && $$PY -m server tiny-model

serve:  ## serve MODEL (default: the tiny model) on HOST:PORT through vlguard (SERVE_ARGS: more flags)
	@$(WITH_MODEL) && \
	  VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} \
	  exec $$PY -m server serve "$$model" --config $(PROFILE) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

serve-stock:  ## the stock vLLM OpenAI server on the same model and profile (vlguard's plugins off)
	@$(WITH_MODEL) && \
	  VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_PLUGINS= \
	  exec $$PY -m server.workload.stock_serve "$$model" --config $(PROFILE) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench:  ## vlguard bench compare --scenario SCENARIO on MODEL and PROFILE (BENCH_ARGS: more bench flags)
	@$(WITH_MODEL) && \
	  exec $$PY -m server bench compare "$$model" --scenario $(SCENARIO) $(BENCH_ARGS) -- --config $(PROFILE)

tools:  ## system tools the deploy tests drive (systemd-analyze), from Debian's packages when missing
	@scripts/system-tools.sh

# mypy's cache lives beside the environments (a clean clone otherwise pays a cold mypy, ~60 s on 2 cores).
lint:  ## ruff (lint + format) and mypy
	@PY=$$(scripts/venv.sh $(VLLM)) && $$PY -m ruff check server tests docs/experiments && \
	  $$PY -m ruff format --check server tests docs/experiments && $$PY -m mypy --cache-dir "$(VLGUARD_CACHE)/mypy-$(VLLM)"

test: $(if $(filter no,$(LINT)),,lint) tools  ## lint, then the test suite (SUITE=full|lane|engine|front) on the lane VLLM (0.20.0, 0.22.1, 0.32.0; front: 0.34.0)
	@paths=; case "$(SUITE)" in full) marker= ;; lane) marker="lane and not full_only" ;; \
	  engine) marker="lane and not full_only"; paths="tests/unit tests/integration" ;; \
	  front) marker="lane and not full_only"; paths="tests/unit tests/api" ;; \
	  *) echo "SUITE must be full, lane, engine or front, not '$(SUITE)'" >&2; exit 2 ;; esac; \
	PY=$$(scripts/venv.sh $(VLLM)) && $$PY -m pytest $${marker:+-m "$$marker"} $(PYTEST_ARGS) $$paths
