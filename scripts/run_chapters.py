"""The canonical run: execute every chapter top to bottom in a fresh kernel and save its outputs in place.

    .venv/bin/python scripts/run_chapters.py [chapters/04_prefill.ipynb ...]

The committed notebooks carry the outputs of this script run on a 2-core CPU machine (no GPU); on a GPU it
produces a reader's own numbers. It prints each chapter's run time and file size.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def run(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - started
    # Live widgets need a kernel; their saved state would make the rendered book load ipywidgets from a CDN.
    notebook.metadata.pop("widgets", None)
    nbformat.write(notebook, path)
    return seconds


def main(paths: list[str]) -> None:
    chapters = [Path(p).resolve() for p in paths] or sorted((ROOT / "chapters").glob("*.ipynb"))
    total = 0.0
    for path in chapters:
        print(f"{path.name}: running ...", flush=True)
        seconds = run(path)
        total += seconds
        print(f"{path.name}: {seconds:.0f} s, {path.stat().st_size / 1e3:.0f} kB", flush=True)
    print(f"{len(chapters)} chapters in {total:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
