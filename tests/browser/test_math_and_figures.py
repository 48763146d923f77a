"""Equations and pictures in the rendered book, in a real browser (same setup as test_rendered_book.py: the built
book on a loopback server, Debian's chromium, every request to another host aborted and reported).

- Every equation is typeset by MathJax served from the book's own _static/mathjax (sphinx-mathjax-offline):
  each math element of the page becomes an mjx-container, none is a MathJax error, and no request leaves the
  machine.
- Every figure a chapter's notebook carries is an image in its page that decodes.
"""

import json

import pytest

from tests.browser.test_rendered_book import (  # noqa: F401  (base_url and browser are fixtures)
    HTML_DIR,
    REPO_ROOT,
    base_url,
    broken_images,
    browser,
    opened,
    wait_until,
)

# The chapters that must carry equations (issue 15): attention, RMSNorm, RoPE, SwiGLU; the KV-memory formula;
# the from-scratch chapter. Any other page with math is checked too.
MATH_CHAPTERS = ["chapters/03_layer0.html", "chapters/05a_from_scratch.html", "chapters/09_memory.html"]
MATH_PAGES = sorted({*MATH_CHAPTERS, *(path.relative_to(HTML_DIR).as_posix() for path in HTML_DIR.glob("**/*.html")
                                       if 'class="math' in path.read_text("utf-8"))} - {"search.html", "genindex.html"})
# Chapters with pictures drawn by kvbook.tools.figures, and how many each draws at least: the concept pictures,
# the sampling distributions (issue 52) and RoPE's rotations.
FIGURE_CHAPTERS = {"chapters/03_layer0": 2, "chapters/05a_from_scratch": 2, "chapters/09_memory": 2,
                   "chapters/13_sampling": 1, "chapters/14_attention": 1}


@pytest.mark.parametrize("page_path", MATH_PAGES)
def test_equations_render_offline(browser, base_url, page_path):  # noqa: F811
    assert (HTML_DIR / page_path).is_file(), f"{page_path} is not in the built book"
    with opened(browser, base_url + page_path) as (page, problems):
        math_elements = page.evaluate("() => document.querySelectorAll('.math').length")
        assert math_elements > 0, f"{page_path}: no equation in the page"
        scripts = page.evaluate("() => [...document.scripts].map(s => s.src).filter(src => /mathjax/i.test(src))")
        assert scripts and all("/_static/mathjax/" in src for src in scripts), f"{page_path}: MathJax from {scripts}"
        typeset = wait_until(page, "n => document.querySelectorAll('mjx-container').length >= n", math_elements,
                             timeout_ms=20_000)
        containers = page.evaluate("() => document.querySelectorAll('mjx-container').length")
        assert typeset, f"{page_path}: {containers} of {math_elements} equations typeset by MathJax"
        errors = page.evaluate("() => [...document.querySelectorAll('mjx-merror')].map(e => e.textContent)")
        assert not errors, f"{page_path}: MathJax errors {errors}"
        # MathJax fetches its fonts and components lazily; give them the time to be requested.
        page.wait_for_load_state("networkidle")
    assert not problems, f"{page_path}:\n" + "\n".join(problems)


def notebook_images(chapter):
    notebook = json.loads((REPO_ROOT / f"{chapter}.ipynb").read_text("utf-8"))
    outputs = [output for cell in notebook["cells"] for output in cell.get("outputs", [])]
    return sum("image/png" in output.get("data", {}) for output in outputs)


@pytest.mark.parametrize("chapter", FIGURE_CHAPTERS)
def test_every_figure_of_the_notebook_is_an_image_in_the_page(browser, base_url, chapter):  # noqa: F811
    expected = notebook_images(chapter)
    assert expected >= FIGURE_CHAPTERS[chapter], f"{chapter}.ipynb has {expected} figures; some are missing"
    with opened(browser, base_url + chapter + ".html") as (page, problems):
        problems.extend(broken_images(page))
        shown = page.evaluate("() => [...document.querySelectorAll('img')].filter(img => "
                              "/_images\\/|jupyter_execute/.test(img.getAttribute('src') || '')).length")
    assert shown == expected, f"{chapter}: {shown} figure images in the page, {expected} in the notebook"
    assert not problems, f"{chapter}:\n" + "\n".join(problems)
