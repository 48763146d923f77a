# make test      -- set up .venv (pinned requirements.txt); run the linter, every chapter under nbval (first, so
#                  that on a new machine chapter 1 draws the weights), the unit tests, the chapters that print
#                  tokens again under other CPU kernels, the book build (zero warnings) and the browser test
# make venv      -- set up .venv from the pinned requirements.txt (nothing else)
# make book      -- set up .venv and build the rendered book from the committed notebook outputs (_build/html)
# make chapters  -- re-execute every chapter on this machine's device and save the outputs (the canonical
#                   run on a CPU machine; on a GPU it gives you your own numbers), then build the book
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test book chapters lint venv clean

# llama.cpp is compiled for this CPU, without its AMX int8 kernels: with them, Q8_0 (and llama.cpp's own Q8_0
# files) crashed with a segmentation fault in the first llama_decode on an AMX Xeon (llama.cpp issue 20824)
LLAMA_CMAKE_ARGS := -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip check
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check lib tests scripts

# nbval compares only what no device's rounding can change (tests/nbval_sanitize.cfg says what it masks). To
# show that on every CI run, the chapters that print greedy tokens run a second time under other CPU kernels on
# the same machine, which round as another CPU's would. On an AVX-512 machine: torch's kernels at AVX2 width and
# oneDNN limited to AVX2. On an AVX2-only machine oneDNN's and MKL's limits change no result (measured once; git
# history has the script), while torch's non-vectorised kernels (ATEN_CPU_CAPABILITY=default) change every op the
# model uses: that is the smallest setting that still exercises other kernels there.
OTHER_KERNELS_WIDE := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
OTHER_KERNELS_NARROW := ATEN_CPU_CAPABILITY=default
OTHER_KERNELS := $(if $(shell grep -m1 -ow avx512f /proc/cpuinfo 2>/dev/null),$(OTHER_KERNELS_WIDE),$(OTHER_KERNELS_NARROW))
# The second pass costs a whole chapter run under slower kernels (on an AVX2-only CPU torch's non-vectorised
# kernels are several times slower), so it runs the two cheapest chapters that print every kind of near-tied
# output and of logit check: top-5 tokens and a greedy choice checked after prefill (4); logits compared within a
# stated tolerance and greedy choices checked after prefill and decode steps (7). Chapters 1, 5, 6, 10 and 11a
# print the same kinds of lines, masked by the same patterns (chapter 6 recomputes in float16, the slowest
# arithmetic under those kernels).
TOKEN_CHAPTERS := $(addprefix chapters/,04_prefill.ipynb 07_pitfalls.ipynb)
NBVAL := $(BIN)/python -m pytest -p no:cacheprovider --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg

test: lint
	$(NBVAL) chapters
	$(BIN)/python -m pytest --ignore=tests/browser
	env $(OTHER_KERNELS) $(NBVAL) $(TOKEN_CHAPTERS)
	$(MAKE) book
	scripts/install_chromium.sh
	$(BIN)/python -m pytest tests/browser

book: $(STAMP)
	$(BIN)/jupyter-book build . -W --keep-going

chapters: $(STAMP)
	$(BIN)/python scripts/run_chapters.py
	$(MAKE) book

clean:
	rm -rf _build .pytest_cache .ruff_cache
