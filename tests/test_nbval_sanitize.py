"""tests/nbval_sanitize.cfg masks the values that another device's rounding may change (greedy token ids, top-token
rows, token agreement) and nothing else of the line; read with nbval's own parser, as `make test` uses it."""

import json
import re
from pathlib import Path

import pytest
from nbval.plugin import get_sanitize_patterns

REPO_ROOT = Path(__file__).resolve().parents[1]
PATTERNS = get_sanitize_patterns((REPO_ROOT / "tests" / "nbval_sanitize.cfg").read_text("utf-8"))
NOTEBOOKS = sorted((REPO_ROOT / "chapters").glob("*.ipynb"))
# What must never be left in a compared output once sanitized: a greedy id after "token id(s):", or a list of ids
# before the next "|" of its line, and a top-token row's id.
UNMASKED = re.compile(r"token ids?: +[0-9]|token ids?:[^|]*\[[0-9]|top token: +[0-9]")


def sanitize(text: str) -> str:
    for regex, replace in PATTERNS:  # as nbval applies them
        text = re.sub(regex, replace, text)
    return text


@pytest.mark.parametrize("line, kept", [
    ("token ids: [32746, 96050, 27224] ...", "token ids:"),
    ("token ids: [141799, 80959] [141799, 80959]", "token ids:"),  # two lists on one line
    ("token id: 31117", "token id:"),
    ("top token:  31117 ' Zend'          p = 0.0013", "top token:"),
    ("top token: 151700 (padding id: no text) p = 0.0011", "top token:"),  # an id past the tokenizer's vocabulary
    ("top token:  12345 \"'s\"          p = 0.0010", "top token:"),
    ("decode step 3: max |Δlogits| / max |logits| < 0.01: True, same next token: False", "< 0.01: True"),
])
def test_each_pattern_masks_the_value_and_keeps_the_rest(line, kept):
    masked = sanitize(line)
    assert not UNMASKED.search(masked), masked
    assert "True, same next token: False" not in masked
    assert kept in masked


def _compared_text(cell) -> str:
    """The text outputs of a code cell that nbval compares (not tagged, not marked to be ignored)."""
    if "nbval-ignore-output" in cell["metadata"].get("tags", []) or "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]):
        return ""
    texts = []
    for output in cell.get("outputs", []):
        texts.append("".join(output.get("text", "")))
        texts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_no_compared_output_shows_a_greedy_token(notebook):
    cells = json.loads(notebook.read_text("utf-8"))["cells"]
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            for line in sanitize(_compared_text(cell)).splitlines():
                assert not UNMASKED.search(line), f"{notebook.name} cell {index}: {line}"
