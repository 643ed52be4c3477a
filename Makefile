# Every target sets up what it needs first (.venv is created or updated only when
# pyproject.toml changed), so a new user needs just `make lab` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minidist-installed
PYTEST := $(PY) -m pytest -p no:cacheprovider
LAB_DIR ?= notebooks
NBVAL  := --nbval --nbval-current-env --nbval-cell-timeout=300
# the slowest tests and a per-file time table (tests/plugins/durations.py) after every run
DURATIONS := --durations=40
# the fast tier: no notebook, no sandboxed grading batch, no browser, nothing marked slow
# (markers are applied by path in conftest.py; tests/README.md says which tier a test joins)
FAST   := -m "not slow and not notebooks and not browser and not gpu"

.PHONY: help setup lab check test test-browser test-lib notebooks lint format bench clean release release-check grade

help:
	@echo "make lab        set up .venv, register the kernel, open JupyterLab on notebooks/"
	@echo "                (LAB_DIR=assignments: on the assignments instead)"
	@echo "make check      the fast tier: lint, release check, every fast test (no notebooks, no grading batches)"
	@echo "make test       set up .venv, run lint, every test and every notebook (what CI runs)"
	@echo "make test-lib   only the library tests (faster while developing)"
	@echo "make test-browser  JupyterLab in headless Chromium, as a student uses it (installs chromium as root)"
	@echo "make notebooks  only the notebooks, checked against their stored outputs (nbval)"
	@echo "make bench      the benchmarks (p2p, launch, collectives, glove, ddp, model_parallel); results in bench-results/"
	@echo "make format     ruff format + autofix"
	@echo "make release    regenerate assignments/ and notebooks/ from solutions/ (instructors)"
	@echo "make grade      grade the example submissions of a1 into grader-results/ (instructors)"
	@echo "                (ASSIGNMENT=a2_async, a3_ddp, a4_compression, a5_model_parallel, a6_inference, a7_zero, a8_experts or a9_resilient: those of a2-a9)"

$(STAMP): pyproject.toml scripts/setup_venv.py
	$(PYTHON) scripts/setup_venv.py --venv $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

# The course kernel: .venv's own python3 kernel, shown as "Python (minidist)" (the notebooks ask
# for python3; inside .venv that name means this kernel). jupyter/ holds the lab settings the
# course ships (no news pop-up, helper packages hidden), added to your own Jupyter configuration.
lab: $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python (minidist)" > /dev/null
	JUPYTER_CONFIG_PATH="$(CURDIR)/jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	$(VENV)/bin/jupyter lab --notebook-dir=$(LAB_DIR) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check: lint release-check
	$(PYTEST) tests $(FAST) $(DURATIONS) $(PYTEST_ARGS)

test: lint release-check
	$(PYTEST) tests solutions $(NBVAL) $(DURATIONS) $(PYTEST_ARGS)

# JupyterLab in headless Chromium, as a student uses it (tests/course/browser). Chromium comes from
# the system's packages (apt-get when run as root; else install it yourself), never downloaded.
test-browser: $(STAMP)
	@if ! command -v chromium > /dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else echo "install Chromium first (Debian/Ubuntu: sudo apt-get install chromium)"; exit 1; fi; \
	fi
	$(PYTEST) -m browser tests/course/browser $(PYTEST_ARGS)

test-lib: $(STAMP)
	$(PYTEST) tests/lib $(DURATIONS) $(PYTEST_ARGS)

# the solved notebooks (solutions/lectures/ and the assignments'); notebooks/ holds the student copies
notebooks: $(STAMP)
	$(PYTEST) solutions $(NBVAL) $(PYTEST_ARGS)

# assignments/ and notebooks/ are generated from solutions/; CI fails when a committed copy is stale.
release: $(STAMP)
	$(PY) -m grader release

release-check: $(STAMP)
	$(PY) -m grader release --check

# The instructor's "hello world": grade a handful of example students (correct, partial,
# wrong, deadlocking, crashing) in sandboxes. GRADE_ARGS="--jobs 2 --force" etc.
GRADE_ARGS ?= --jobs 2 --test-timeout 10
ASSIGNMENT ?= a1_collectives
grade: $(STAMP)
	rm -rf grader-results/submissions-$(ASSIGNMENT)
	$(PY) -m grader.examples.$(ASSIGNMENT).make grader-results/submissions-$(ASSIGNMENT)
	$(PY) -m grader grade $(ASSIGNMENT) grader-results/submissions-$(ASSIGNMENT) --out grader-results/$(ASSIGNMENT) $(GRADE_ARGS)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) -m minidist.bench p2p
	$(PY) -m minidist.bench launch
	$(PY) -m minidist.bench collectives --world-size 2
	$(PY) -m minidist.bench collectives --world-size 4
	$(PY) -m minidist.bench glove
	$(PY) -m minidist.bench ddp
	$(PY) -m minidist.bench model_parallel

clean:
	rm -rf $(VENV) bench-results grader-results browser-artifacts .pytest_cache .ruff_cache
