"""The canonical run: execute every chapter top to bottom in a fresh kernel and save its outputs in place.

    .venv/bin/python scripts/run_chapters.py [chapters/04_prefill.ipynb ...]

The committed notebooks carry the outputs of one sitting of this script over every chapter; on a GPU it produces
a reader's own numbers. Each notebook's metadata gets the sitting's stamp: the hash of the tree that computed it
(kvbook.tools.book.tree_hash), the machine, the sitting's start and the chapter's run time. tests/test_book_run.py
fails when the stamps differ from each other or from the tree. It prints each chapter's run time and file size.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lib"))
from kvbook.tools.book import machine_name, tree_hash  # noqa: E402


def run(path: Path, stamp: dict) -> float:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - started
    # Live widgets need a kernel; their saved state would make the rendered book load ipywidgets from a CDN.
    notebook.metadata.pop("widgets", None)
    notebook.metadata["kvbook"] = {**stamp, "seconds": round(seconds)}
    nbformat.write(notebook, path)
    return seconds


def main(paths: list[str]) -> None:
    chapters = [Path(p).resolve() for p in paths] or sorted((ROOT / "chapters").glob("*.ipynb"))
    stamp = {"tree": tree_hash(ROOT), "machine": machine_name(), "sitting": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                       time.gmtime())}
    total = 0.0
    for path in chapters:
        print(f"{path.name}: running ...", flush=True)
        seconds = run(path, stamp)
        total += seconds
        print(f"{path.name}: {seconds:.0f} s, {path.stat().st_size / 1e3:.0f} kB", flush=True)
    print(f"{len(chapters)} chapters in {total:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
