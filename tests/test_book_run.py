"""The book is one run: every chapter's committed outputs carry the stamp of one sitting of scripts/run_chapters.py
on the current tree (kvbook.tools.book.tree_hash), so an engine change not followed by a fresh run cannot land."""

from pathlib import Path

import nbformat
from kvbook.tools.book import tree_hash

ROOT = Path(__file__).resolve().parents[1]


def test_every_chapter_comes_from_one_sitting_on_this_tree():
    stamps = {path.name: nbformat.read(path, as_version=4).metadata.get("kvbook", {})
              for path in sorted((ROOT / "chapters").glob("*.ipynb"))}
    unstamped = [name for name, stamp in stamps.items() if not stamp]
    assert not unstamped, f"never run by scripts/run_chapters.py: {unstamped}"
    sittings = {(s["tree"], s["machine"], s["sitting"]) for s in stamps.values()}
    assert len(sittings) == 1, f"the chapters come from several runs: {sorted(sittings)}; run make chapters"
    tree = next(iter(sittings))[0]
    assert tree == tree_hash(ROOT), "lib/, config.toml or a chapter's code changed since the run: run make chapters"


def test_the_tree_hash_follows_the_code_not_the_outputs(tmp_path):
    for part in ("lib/kvbook", "chapters"):
        (tmp_path / part).mkdir(parents=True)
    (tmp_path / "config.toml").write_text("[model]\n")
    (tmp_path / "lib/kvbook/a.py").write_text("x = 1\n")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nbformat.write(notebook, tmp_path / "chapters/01.ipynb")
    before = tree_hash(tmp_path)
    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nbformat.write(notebook, tmp_path / "chapters/01.ipynb")
    assert tree_hash(tmp_path) == before
    (tmp_path / "lib/kvbook/a.py").write_text("x = 2\n")
    assert tree_hash(tmp_path) != before
