# Two commands for a newcomer (both idempotent; they install what they need first):
#   make demo      – the tutorial's FP32-vs-AMP comparison (plus bf16) on Fashion-MNIST, as one bench (CNN, batch 256)
#   make test      – the whole test suite (what CI runs), listing the 20 slowest tests
# and one for each edit:
#   make test-fast – every test not marked slow (end-to-end runs through the CLI, a subprocess or a whole
#                    training run, or anything taking more than about a second): the suite's fast tier
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
FORTUNES := /usr/share/games/fortunes/fortunes

PYTEST := $(BIN)/python -m pytest -q

.PHONY: demo test test-fast setup data clean

demo: setup data
	$(BIN)/mixprec bench --precisions fp32,amp,bf16-mixed --model cnn --batch-size 256 --epochs 2 --repeats 2 \
		--out runs/demo

test: setup data
	$(PYTEST) --durations=20

test-fast: setup data
	$(PYTEST) -m "not slow"

setup: $(VENV)/.installed

# torch is pinned to the CPU build that lies on this machine's disk (constraints.txt, so the test extras —
# transformers, lightning, torchao, tensorboard — install beside it instead of pulling another torch);
# pyproject accepts torch>=2.4.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

data: $(FMNIST) $(FORTUNES)

$(FMNIST):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq dataset-fashion-mnist

# real English text for the language-model case (--model gpt --dataset text)
$(FORTUNES):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq fortunes

clean:
	rm -rf $(VENV) runs .pytest_cache
