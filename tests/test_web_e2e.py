"""The demo page in real headless Chromium (Debian's ``chromium`` driven by Playwright, no browser
download): load the page, submit an image and an article, check that the caption and the
attention heatmap appear, hover a word, see an error shown, draw an expression and get LaTeX
rendered by the locally installed KaTeX. Every request must go to the loopback server (no CDN).
A screenshot is saved to ``$TELLKIT_TEST_ARTIFACTS`` (default ``build/test-artifacts/``).

Skips with a reason when chromium or playwright is missing, except in CI (``CI=true``), where
``.ci/run`` installs chromium and ``make setup`` installs playwright, so a missing one fails."""
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
from PIL import Image, ImageDraw

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


def _need(ok: bool, reason: str):
    if not ok:
        if IN_CI:
            pytest.fail(f"{reason} (required in CI)")
        pytest.skip(reason)


def find_chromium() -> str | None:
    for c in (os.environ.get("TELLKIT_CHROMIUM"), "chromium", "chromium-browser"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    _need(exe is not None, "Debian's chromium is not installed (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"], timeout=60_000)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    from tellkit.server.app import create_app
    from tellkit.server.backends import CaptioningPipeline, RecognitionPipeline
    from tellkit.server.runner import ServerThread

    app = create_app(CaptioningPipeline.untrained(), RecognitionPipeline.untrained())
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture()
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    outside = []

    def guard(route):
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    pg.route("**/*", guard)
    pg.goto(server.url + "/")
    yield pg
    ctx.close()
    assert not outside, f"the page tried to reach the internet: {outside}"


def artifact_dir() -> Path:
    d = Path(os.environ.get("TELLKIT_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def scene(path: Path) -> Path:
    """A made-up 'photo': sky, ground, a red disc (no faces; the untrained model captions noise)."""
    a = np.zeros((240, 320, 3), np.uint8)
    a[:140] = (110, 160, 230)
    a[140:] = (70, 130, 60)
    im = Image.fromarray(a)
    ImageDraw.Draw(im).ellipse((200, 40, 260, 100), fill=(220, 40, 30))
    im.save(path)
    return path


def test_caption_flow_shows_caption_heatmap_and_article_attention(page, tmp_path):
    page.wait_for_function("document.getElementById('status').textContent.includes('UNTRAINED')")
    page.set_input_files("#caption-file", str(scene(tmp_path / "scene.png")))
    page.fill("#article", "Firefighters in Lyon rescued a red balloon from a tree on Sunday, the mayor said.")
    page.click("#caption-submit")
    page.wait_for_selector("#caption .word")
    words = page.locator("#caption .word")
    assert words.count() >= 1
    assert page.inner_text("#caption").strip()
    assert page.get_attribute("#overlay", "data-heatmap") == "drawn"
    # the heatmap really is on the canvas: count painted pixels
    painted = page.evaluate("""() => { const c = document.getElementById('overlay');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return [n, c.width * c.height]; }""")
    assert painted[0] > 0.5 * painted[1], painted  # the grid covers the centre crop: most of the image
    # hovering a word moves the focus and highlights article words
    last = words.nth(words.count() - 1)
    last.hover()
    page.wait_for_function("document.getElementById('focus').textContent.startsWith('word ' + "
                           f"{words.count()})")
    lit = page.evaluate("Array.from(document.querySelectorAll('#article-view .tok'))"
                        ".filter(s => s.style.background).length")
    assert lit >= 1
    assert page.is_hidden("#error")
    page.screenshot(path=str(artifact_dir() / "web_e2e_caption.png"), full_page=True)


def test_detected_faces_are_drawn_and_weighted(page):
    demo = ROOT / "src" / "tellkit" / "assets" / "demo_caption"
    page.set_input_files("#caption-file", str(demo / "astronaut.jpg"))  # NASA portrait (public domain)
    page.fill("#article", (demo / "astronaut.txt").read_text(encoding="utf-8"))
    page.click("#caption-submit")
    page.wait_for_selector("#caption .word")
    assert page.get_attribute("#overlay", "data-faces") == "1"
    item = page.inner_text("#faces li")
    assert item.startswith("face 1") and item.strip().endswith("%")
    page.screenshot(path=str(artifact_dir() / "web_e2e_faces.png"), full_page=True)


def test_errors_are_shown_to_the_person(page, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not an image")
    page.set_input_files("#caption-file", str(bad))
    page.click("#caption-submit")
    page.wait_for_selector("#error:not([hidden])")
    msg = page.inner_text("#error")
    assert "Captioning failed" in msg and "415" in msg


def test_math_tab_draw_recognize_and_render(page):
    assert page.is_hidden("#panel-math") and page.is_hidden("#caption-result")
    page.click("#tab-math")
    assert page.is_hidden("#panel-caption") and page.is_visible("#pad")
    box = page.locator("#pad").bounding_box()
    page.mouse.move(box["x"] + 60, box["y"] + 100)
    page.mouse.down()
    for dx in range(0, 200, 20):
        page.mouse.move(box["x"] + 60 + dx, box["y"] + 100 + (dx % 40) - 20)
    page.mouse.up()
    page.click("#pad-recognize")
    page.wait_for_function("document.getElementById('latex').textContent.length > 0 || "
                           "!document.getElementById('error').hidden")
    latex = page.inner_text("#latex").strip()
    assert latex, page.inner_text("#error")
    # the recognised LaTeX is rendered, or the reason it cannot be is shown
    assert page.locator("#rendered .katex").count() == 1 or "does not render" in page.inner_text("#error")
    # KaTeX (installed locally at set-up) renders a known expression
    page.evaluate("renderLatex('x ^ { 2 } + \\\\frac { 1 } { y }')")
    assert page.locator("#rendered .katex").count() == 1
    assert "x" in page.inner_text("#rendered")
    page.screenshot(path=str(artifact_dir() / "web_e2e_math.png"), full_page=True)
    # an uploaded expression image is recognised as soon as it is chosen
    page.evaluate("document.getElementById('latex').textContent = ''")
    page.set_input_files("#math-file", str(ROOT / "src" / "tellkit" / "assets" / "samples" / "bttr_x2_plus_1.png"))
    page.wait_for_function("document.getElementById('latex').textContent.length > 0")
    assert "bttr_x2_plus_1.png" in page.inner_text("#math-drop-text")


def test_first_visit_offers_samples_one_click_away(page):
    """The packaged photos are on the page at once; one click captions one (with its article);
    on the math tab one click draws the sample formula's strokes on the pad and reads them."""
    page.wait_for_selector("#caption-samples button.sample")
    names = page.eval_on_selector_all("#caption-samples button.sample", "bs => bs.map(b => b.dataset.sample)")
    assert {"chelsea.jpg", "rocket.jpg"} <= set(names)
    page.click("#caption-samples button[data-sample='rocket.jpg']")
    page.wait_for_selector("#caption-result:not([hidden])")
    page.wait_for_function("document.getElementById('caption').textContent.length > 0")
    assert "rocket.jpg" in page.inner_text("#caption-drop-text")
    assert "Falcon 9" in page.input_value("#article")
    page.screenshot(path=str(artifact_dir() / "web_e2e_samples.png"), full_page=True)
    page.click("#tab-math")
    page.click("#math-sample")
    page.wait_for_function("document.getElementById('latex').textContent.length > 0 || "
                           "!document.getElementById('error').hidden")
    assert page.inner_text("#latex").strip(), page.inner_text("#error")
    inked = page.evaluate("""() => {
        const c = document.getElementById('pad'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 128) n++; return n; }""")
    assert inked > 200  # the strokes were drawn on the pad
