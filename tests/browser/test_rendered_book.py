"""The rendered book in a real browser (Debian's chromium, driven by Playwright).

Every chapter page must load with no JavaScript error, no broken image and no request leaving the machine, every
matplotlib ``to_jshtml`` animation must change frame when its slider moves, and chapter 5's decode-step scrubber
(kvbook.tools.book.static_scrubber) must show every layer's cache length, the attention row and the top-5 tokens of the
step its slider is moved to.

Needs the built book (``.venv/bin/jupyter-book build . -W``) and /usr/bin/chromium (``scripts/install_chromium.sh``).
``KVBOOK_HTML_DIR=/some/_build/html`` points the tests at another built book (default: ``_build/html`` at the
repository root), e.g. a scratch book used to check the tests themselves.
"""

import contextlib
import functools
import html.parser
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pandas as pd
import pytest
import torch
from kvbook.tools.book import DecodeRecording, static_scrubber
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import sync_playwright

REPO_ROOT = Path(__file__).resolve().parents[2]
HTML_DIR = Path(os.environ.get("KVBOOK_HTML_DIR", REPO_ROOT / "_build" / "html")).resolve()
CHAPTER_PAGES = sorted(path.relative_to(HTML_DIR).as_posix() for path in HTML_DIR.glob("chapters/*.html"))
# The intro and the benchmarks page (in _toc.yml: the chapters link to it) are listed even when they are missing,
# so that an unbuilt book is a failure rather than zero tests.
PAGES = ["intro.html", *CHAPTER_PAGES, "BENCHMARKS.html"]
# to_jshtml writes its slider into the page as literal HTML, so the built files tell which pages have one.
SLIDER_PAGES = [page for page in PAGES
                if (HTML_DIR / page).is_file() and 'class="anim-slider"' in (HTML_DIR / page).read_text("utf-8")]

# The article's scenario in chapter 5: a 256-token prompt, then decode steps 1..127, each adding one position to the
# cache of each of the 3 layers.
SCRUBBER_PAGE = "chapters/05_decode.html"
SCRUBBER_CACHE_LENS = {1: 257, 64: 320, 127: 383}
SCRUBBER_LAYERS = 3

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
LOOPBACK = "127.0.0.1"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the test report
        pass


@pytest.fixture(scope="module")
def base_url():
    """Serves the built book on a free loopback port for the duration of the module."""
    if not (HTML_DIR / "index.html").is_file():
        pytest.fail(f"no built book at {HTML_DIR}: run `.venv/bin/jupyter-book build . -W` first", pytrace=False)
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), functools.partial(_QuietHandler, directory=HTML_DIR))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_port}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install_chromium.sh first", pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def _is_external(url):
    return urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname != LOOPBACK


@contextlib.contextmanager
def opened(browser, url):
    """Yields the loaded page at url and the list of problems (page errors, console errors, outside requests)."""
    page = browser.new_page()
    problems = []

    def keep_offline(route):
        # Policy: the book must render offline, so ANY request to a host other than 127.0.0.1 (a CDN, a web font,
        # MathJax...) is a FAILURE. It is aborted rather than let through, so the verdict does not depend on whether
        # the machine running the test happens to have network.
        if _is_external(route.request.url):
            problems.append(f"request leaves the machine (the book must render offline): {route.request.url}")
            route.abort()
        else:
            route.continue_()

    def console_error(message):
        # An aborted outside request also logs "Failed to load resource"; it is already reported above.
        if message.type == "error" and not _is_external(message.location.get("url", "")):
            problems.append(f"console error: {message.text} ({message.location.get('url')})")

    page.route("**/*", keep_offline)
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", console_error)
    try:
        response = page.goto(url, wait_until="load")
        assert response is not None and response.ok, f"{url}: HTTP {response and response.status}"
        yield page, problems
    finally:
        page.close()


def broken_images(page):
    """Names of the <img> elements that did not load (every image counts, animation frames included)."""
    # Lazy images only load near the viewport: make them eager and bring each into view.
    page.evaluate("() => { for (const img of document.images) { img.loading = 'eager'; img.scrollIntoView(); } }")
    # No assert here: the list below names whatever never finished.
    wait_until(page, "() => [...document.images].every(img => img.src && img.complete)", timeout_ms=10_000)
    return page.evaluate("""() => [...document.images]
        .filter(img => !(img.complete && img.naturalWidth > 0))
        .map(img => 'broken image: ' + (img.id || img.getAttribute('src') || img.outerHTML).slice(0, 120))""")


class _PageTags(html.parser.HTMLParser):
    """Every <a href> of a page, and the attributes of every <img>."""

    def __init__(self):
        super().__init__()
        self.hrefs, self.images = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "a" and dict(attrs).get("href"):
            self.hrefs.append(dict(attrs)["href"])
        elif tag == "img":
            self.images.append(dict(attrs))


# What the repository's files are called: a link to a "host" with one of these endings is a file name that MyST's
# linkify took for a web address (it once sent every "BENCHMARKS.md" in the text to http://BENCHMARKS.md).
FILE_SUFFIXES = (".md", ".py", ".json", ".toml", ".yml", ".ipynb", ".sh", ".txt")


@pytest.mark.parametrize("page_path", PAGES)
def test_every_link_of_a_page_leads_somewhere(page_path):
    """No file name in the text becomes a link to a web host, and every link inside the book finds its page."""
    assert (HTML_DIR / page_path).is_file(), f"{page_path} is not in the built book"
    links = _PageTags()
    links.feed((HTML_DIR / page_path).read_text("utf-8"))
    problems = []
    for href in links.hrefs:
        url = urlsplit(href)
        if url.scheme in ("http", "https"):
            if (url.hostname or "").endswith(FILE_SUFFIXES):
                problems.append(f"a file name linked as a web host: {href}")
        elif not url.scheme and url.path:
            if not (HTML_DIR / page_path).parent.joinpath(unquote(url.path)).resolve().exists():
                problems.append(f"a link to a page the book does not have: {href}")
    assert not problems, f"{page_path}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page_path", PAGES)
def test_every_figure_of_a_page_has_alt_text(page_path):
    """Each figure's <img> carries the text its cell's metadata gives (a reader who cannot see it gets that). An
    animation's frame gets its alt from kvbook.tools.book when its chapter runs (tests/test_figures.py); chapter 9's
    committed animation was rendered before that, so frames are left out here until its next canonical run."""
    images = _PageTags()
    images.feed((HTML_DIR / page_path).read_text("utf-8"))
    figures = [image for image in images.images if not image.get("id", "").startswith("_anim_img")]
    missing = [image.get("src", "?") for image in figures if len((image.get("alt") or "").strip()) < 20]
    assert not missing, f"{page_path}: images without alt text: {missing}"


@pytest.mark.parametrize("page_path", PAGES)
def test_page_renders_offline_without_errors(browser, base_url, page_path):
    with opened(browser, base_url + page_path) as (page, problems):
        problems.extend(broken_images(page))
    assert not problems, f"{page_path}:\n" + "\n".join(problems)


# Collected only when there is something to check: before any chapter is written there is no animation, and an
# empty parametrization would show up as a skip. Once chapters exist, at least one must carry an animation.
if CHAPTER_PAGES or SLIDER_PAGES:

    def test_animation_sliders_change_frame(browser, base_url):
        if CHAPTER_PAGES:
            assert set(SLIDER_PAGES) & set(CHAPTER_PAGES), "no chapter page has a matplotlib to_jshtml animation"
        for page_path in SLIDER_PAGES:
            with opened(browser, base_url + page_path) as (page, problems):
                sliders = page.locator("input.anim-slider").all()
                assert sliders, f"{page_path}: the HTML has an anim-slider but the browser shows none"
                for slider in sliders:
                    check_slider(page, page_path, slider)
            assert not problems, f"{page_path}:\n" + "\n".join(problems)


def check_slider(page, page_path, slider):
    name = f"{page_path}: animation {slider.get_attribute('id')}"
    image = page.locator("#" + slider.get_attribute("id").replace("_anim_slider", "_anim_img")).element_handle()
    # matplotlib's Animation object shows the first frame from a setTimeout, after the page has parsed.
    shown = wait_until(page, "img => img.src !== ''", image)
    assert shown, f"{name}: no frame is ever shown"
    last_frame = int(slider.get_attribute("max"))
    assert last_frame >= 1, f"{name}: has a single frame"
    frame_before = image.evaluate("img => img.src")
    next_frame = (int(slider.input_value()) + 1) % (last_frame + 1)
    # matplotlib's template listens with oninput (it switches to onchange only on Internet Explorer), and setting
    # .value from script fires no event, so the event is dispatched by hand, as a user's drag would.
    slider.evaluate("(el, value) => { el.value = value; el.dispatchEvent(new Event('input', {bubbles: true})); }",
                    str(next_frame))
    # Compared in the page and kept out of the assert expression: pytest would print the base64 frames.
    changed = wait_until(page, "([img, before]) => img.src !== before", [image, frame_before])
    assert changed, f"{name}: moving the slider to frame {next_frame} did not change the image"
    decoded = wait_until(page, "img => img.complete && img.naturalWidth > 0", image)
    assert decoded, f"{name}: frame {next_frame} does not decode"


def wait_until(page, predicate, arg=None, timeout_ms=5_000):
    """Whether the JavaScript predicate(arg) becomes true within the timeout."""
    try:
        page.wait_for_function(predicate, arg=arg, timeout=timeout_ms)
    except PlaywrightTimeoutError:
        return False
    return True


def move_scrubber(page, scrubber, step):
    """Sets the scrubber's slider to step as a user's drag would (an input event), and waits until it is drawn."""
    scrubber.locator("input.kvs-step").evaluate(
        "(el, value) => { el.value = value; el.dispatchEvent(new Event('input', {bubbles: true})); }", str(step))
    return wait_until(page, "([el, step]) => el.textContent === step",
                      [scrubber.locator(".kvs-step-value").element_handle(), str(step)])


def scrubber_state(scrubber):
    """What the reader sees: each layer's cache length, the attention bars and their text, the top-5 rows."""
    bars = scrubber.locator("path.kvs-bars")
    return {"cache_lens": scrubber.locator(".kv-cache-len").all_inner_texts(),
            "positions": bars.get_attribute("data-positions"), "bars": bars.get_attribute("d"),
            "attention_text": scrubber.locator(".kvs-attention-text").inner_text(),
            "top": scrubber.locator(".kvs-top tbody tr").all_inner_texts()}


if CHAPTER_PAGES:

    def test_decode_scrubber_moves_to_steps_1_64_and_127(browser, base_url):
        assert SCRUBBER_PAGE in CHAPTER_PAGES, f"no {SCRUBBER_PAGE} in the built book"
        with opened(browser, base_url + SCRUBBER_PAGE) as (page, problems):
            scrubber = page.locator(".kvbook-scrubber")
            assert scrubber.count() == 1, f"{SCRUBBER_PAGE}: expected one decode-step scrubber"
            slider = scrubber.locator("input.kvs-step")
            assert (slider.get_attribute("min"), slider.get_attribute("max")) == ("1", "127"), \
                "the scrubber must run over decode steps 1..127 (prefill is not a decode step)"
            seen = {}
            for step, cache_len in SCRUBBER_CACHE_LENS.items():
                assert move_scrubber(page, scrubber, step), f"moving the slider to {step} is never drawn"
                state = seen[step] = scrubber_state(scrubber)
                assert state["cache_lens"] == [str(cache_len)] * SCRUBBER_LAYERS, f"step {step}: {state['cache_lens']}"
                assert state["positions"] == str(cache_len), f"step {step}: attention over {state['positions']}"
                assert f"all {cache_len} cached positions" in state["attention_text"]
                assert len(state["top"]) == 5 and all(row.strip() for row in state["top"]), state["top"]
            for key in ("bars", "attention_text", "top"):
                assert len({str(state[key]) for state in seen.values()}) == len(seen), f"{key} is the same at two steps"
            # another head: the bars and their text change, the cache lengths do not
            select = scrubber.locator("select.kvs-head")
            assert select.locator("option").count() >= 2, "the scrubber offers a single head"
            select.select_option(index=select.locator("option").count() - 1)
            other = scrubber_state(scrubber)
            assert other["bars"] != seen[127]["bars"] and other["attention_text"] != seen[127]["attention_text"]
            assert other["cache_lens"] == seen[127]["cache_lens"]
        assert not problems, f"{SCRUBBER_PAGE}:\n" + "\n".join(problems)


class HostileTokenizer:
    """Token texts that would end the scrubber's script element, or inject markup, if written into the page raw."""

    def token_text(self, token_id):
        return f"</script><img src=x onerror=alert({token_id})><!--"


def synthetic_recording(prompt_len=4, steps=3, layers=2, heads=2, vocab=50):
    """A DecodeRecording made up in place of a run: enough for the page to draw, no model needed."""
    generator = torch.Generator().manual_seed(0)
    table = pd.DataFrame({"phase": ["prefill"] + ["decode"] * steps, "step": range(steps + 1),
                          "token_id": range(10, 11 + steps), "ms": [100.0] + [50.0] * steps,
                          "cache_len": range(prompt_len, prompt_len + steps + 1), "prompt_len": prompt_len})
    attention = {(step, layer): torch.softmax(torch.randn(heads, 1, prompt_len + step, generator=generator), -1)
                 for step in range(1, steps + 1) for layer in range(layers)}
    logits = {step: torch.randn(vocab, generator=generator) for step in range(steps + 1)}
    return DecodeRecording(table, attention, logits, prompt_len, layers, heads)


def test_scrubber_shows_token_text_as_text_not_markup(browser):
    """Token text is data: a token that reads like HTML shows as those characters and runs nothing."""
    page = browser.new_page()
    problems = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("dialog", lambda dialog: (problems.append(f"a token ran script: {dialog.message}"), dialog.dismiss()))
    try:
        page.set_content(static_scrubber(synthetic_recording(), HostileTokenizer()).data, wait_until="load")
        scrubber = page.locator(".kvbook-scrubber")
        assert move_scrubber(page, scrubber, 3)
        state = scrubber_state(scrubber)
        assert state["cache_lens"] == ["7", "7"] and state["positions"] == "7"
        tokens = scrubber.locator(".kvs-top td.kvs-token").all_inner_texts()
        assert len(tokens) == 5 and all(text.startswith("'</script><img src=x onerror=alert(") for text in tokens)
        assert page.locator("img").count() == 0
    finally:
        page.close()
    assert not problems, "\n".join(problems)
