# make test      -- set up .venv (pinned requirements.txt); run the linter, the unit tests, every chapter under
#                  nbval, the book build (zero warnings) and the browser test of the built pages
# make book      -- set up .venv and build the rendered book from the committed notebook outputs (_build/html)
# make chapters  -- re-execute every chapter on this machine's device and save the outputs (the canonical
#                   run on a CPU machine; on a GPU it gives you your own numbers), then build the book
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test book chapters lint venv clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip check
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check lib tests

test: lint
	$(BIN)/python -m pytest --ignore=tests/browser
	$(BIN)/python -m pytest -p no:cacheprovider --nbval chapters --nbval-sanitize-with tests/nbval_sanitize.cfg
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
