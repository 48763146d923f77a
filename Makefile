# make test  -- set up .venv (pinned requirements.txt) and run the linter and every test
# make book  -- set up .venv and build the rendered book from the committed notebook outputs (_build/html)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test book lint venv clean

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
	$(BIN)/python -m pytest

book: $(STAMP)
	$(BIN)/jupyter-book build . -W --keep-going

clean:
	rm -rf _build .pytest_cache .ruff_cache
