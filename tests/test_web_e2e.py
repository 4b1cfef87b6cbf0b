"""The demo page in real headless Chromium (Debian's ``chromium`` driven by Playwright, no browser
download): load the page, submit an image and an article, check that the caption and the
attention heatmap appear, hover a word, see an error shown, draw an expression and get LaTeX
rendered by the locally installed KaTeX; at a phone's width (390 CSS px) and a desktop's (1280)
the page stays within the viewport after a caption and a recognition; a new request or an error
greys or clears the previous result; a confidence and an "unsure" flag are shown when the API
sends them. Every request must go to the loopback server (no CDN). Screenshots are saved to
``$TELLKIT_TEST_ARTIFACTS`` (default ``build/test-artifacts/``).

Skips with a reason when chromium or playwright is missing, except in CI (``CI=true``), where
``.ci/run`` installs chromium and ``make setup`` installs playwright, so a missing one fails."""
import json
import math
import os
import re
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

    app = create_app({"caption": CaptioningPipeline.untrained(), "recognize": RecognitionPipeline.untrained()})
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture()
def open_page(browser, server):
    """open_page(width, height=900) -> the demo page in a fresh browser context of that viewport."""
    contexts, outside = [], []

    def guard(route):
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost"):
            route.fallback()
        else:
            outside.append(route.request.url)
            route.abort()

    def open_(width: int, height: int = 900):
        ctx = browser.new_context(viewport={"width": width, "height": height})
        contexts.append(ctx)
        pg = ctx.new_page()
        pg.set_default_timeout(30_000)
        pg.route("**/*", guard)
        pg.goto(server.url + "/")
        return pg

    yield open_
    for ctx in contexts:
        ctx.close()
    assert not outside, f"the page tried to reach the internet: {outside}"


@pytest.fixture()
def page(open_page):
    return open_page(1280)


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


def test_errors_are_shown_to_the_person_and_clear_the_old_result(page, tmp_path):
    page.set_input_files("#caption-file", str(scene(tmp_path / "scene.png")))
    page.click("#caption-submit")
    page.wait_for_selector("#caption .word")
    assert page.is_visible("#caption-result")
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not an image")
    page.set_input_files("#caption-file", str(bad))
    assert "stale" in page.get_attribute("#caption-result", "class")  # chosen: the old result is greyed
    page.click("#caption-submit")
    page.wait_for_selector("#error:not([hidden])")
    msg = page.inner_text("#error")
    assert "Captioning failed" in msg and "415" in msg
    assert page.is_hidden("#caption-result")  # not left beside the error as if it answered


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
    assert {"chelsea.jpg", "rocket.jpg", "dogs.jpg"} <= set(names)
    # photos like the model's training data come first, those unlike them in a group of their own
    groups = page.eval_on_selector_all("#caption-samples .sample-group", """gs => gs.map(g => [g.dataset.domain,
        Array.from(g.querySelectorAll('button.sample')).map(b => b.dataset.sample)])""")
    assert [d for d, _ in groups] == ["inside", "outside"]
    assert "dogs.jpg" in groups[0][1] and "rocket.jpg" in groups[1][1]
    page.click("#caption-samples button[data-sample='rocket.jpg']")
    page.wait_for_selector("#caption-result:not([hidden])")
    page.wait_for_function("document.getElementById('caption').textContent.length > 0")
    assert "rocket.jpg" in page.inner_text("#caption-drop-text")
    assert "Falcon 9" in page.input_value("#article")
    page.screenshot(path=str(artifact_dir() / "web_e2e_samples.png"), full_page=True)
    page.click("#tab-math")
    formulas = page.eval_on_selector_all("#math-samples button.formula", "bs => bs.map(b => b.dataset.sample)")
    assert len(formulas) >= 4 and formulas[0] == "bttr_x2_plus_1.inkml"
    assert page.locator("#math-samples button.formula .katex").count() == len(formulas)  # labels rendered
    page.click("#math-samples button.formula >> nth=1")
    page.wait_for_function("document.getElementById('latex').textContent.length > 0 || "
                           "!document.getElementById('error').hidden")
    assert page.inner_text("#latex").strip(), page.inner_text("#error")
    inked = page.evaluate("""() => {
        const c = document.getElementById('pad'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 128) n++; return n; }""")
    assert inked > 200  # the strokes were drawn on the pad


# ---------------------------------------------------------------- layout, state, confidence

WIDTH_JS = """() => Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"""
ERROR_OR = "!document.getElementById('error').hidden || "


def page_width(page) -> int:
    return page.evaluate(WIDTH_JS)


def box(page, selector) -> dict:
    return page.locator(selector).bounding_box()


def draw_scribble(page, points: int = 40, turns: float = 6.0):
    """A wave across most of the pad's width, as a person drags the mouse (``points`` moves)."""
    b = box(page, "#pad")
    page.mouse.move(b["x"] + 0.05 * b["width"], b["y"] + 0.5 * b["height"])
    page.mouse.down()
    for i in range(points):
        t = i / (points - 1)
        page.mouse.move(b["x"] + (0.05 + 0.9 * t) * b["width"],
                        b["y"] + (0.5 + 0.2 * math.sin(2 * math.pi * turns * t)) * b["height"])
    page.mouse.up()


def strokes_sent(request) -> list:
    """The 'strokes' field of a multipart POST."""
    found = re.search(r'name="strokes"\r\n\r\n(.*?)\r\n--', request.post_data, re.S)
    assert found, request.post_data[:300]
    return json.loads(found.group(1))


@pytest.mark.parametrize("width", [390, 1280])
def test_the_page_stays_within_the_viewport_after_a_caption_and_a_recognition(open_page, width):
    page = open_page(width, 844 if width == 390 else 900)
    assert page_width(page) <= width
    page.wait_for_selector("#caption-samples button.sample")
    page.click("#caption-samples button[data-sample='dogs.jpg']")
    page.wait_for_selector("#caption .word")
    page.wait_for_function("document.getElementById('overlay').dataset.heatmap === 'drawn'")
    assert page_width(page) <= width, f"the page is {page_width(page)} px wide after a caption"
    img, side = box(page, "#caption-image"), box(page, "#caption-result .side")
    assert img["x"] >= 0 and img["x"] + img["width"] <= width
    assert box(page, "#overlay")["width"] == pytest.approx(img["width"], abs=1)  # the heatmap covers the photo
    if width == 390:  # stacked: the text under the photo
        assert side["y"] >= img["y"] + img["height"] - 1
    else:  # side by side, the inputs beside the result
        assert side["x"] >= img["x"] + img["width"] - 1
        assert box(page, "#caption-form")["x"] + 300 < img["x"]
    page.screenshot(path=str(artifact_dir() / f"web_e2e_{width}_caption.png"), full_page=True)

    page.click("#tab-math")
    pad = box(page, "#pad")
    assert pad["x"] >= 0 and pad["x"] + pad["width"] <= width
    assert pad["width"] / pad["height"] == pytest.approx(640 / 200, rel=0.02)  # not squashed
    with page.expect_request("**/api/recognize") as req:
        draw_scribble(page)
        page.click("#pad-recognize")
    page.wait_for_function(ERROR_OR + "document.getElementById('latex').textContent.length > 0")
    assert page.is_hidden("#error"), page.inner_text("#error")
    assert page_width(page) <= width, f"the page is {page_width(page)} px wide after a recognition"
    # the strokes are in the pad's 640 x 200 drawing space whatever its size on screen, 1 decimal
    (stroke,) = strokes_sent(req.value)
    xs, ys = [p[0] for p in stroke], [p[1] for p in stroke]
    assert 0 <= min(xs) < 0.1 * 640 and 0.9 * 640 < max(xs) <= 640, (min(xs), max(xs))
    assert 0.25 * 200 < min(ys) < 0.35 * 200 and 0.65 * 200 < max(ys) < 0.75 * 200
    assert all(round(v, 1) == v for p in stroke for v in p)
    page.screenshot(path=str(artifact_dir() / f"web_e2e_{width}_math.png"), full_page=True)


def test_a_long_drawing_is_rounded_and_thinned_to_the_servers_limits(page):
    """1,200 pointer moves: the page sends one decimal of the pad's coordinates, and thins the
    points out when the JSON would still pass the server's limit on the strokes field."""
    page.click("#tab-math")
    assert page.evaluate("state.maxFieldChars") >= 20_000  # from /health
    for k in range(4):
        draw_scribble(page, points=300, turns=3 + k)
    raw = len(page.evaluate("JSON.stringify(state.strokes)"))
    page.evaluate("state.maxFieldChars = 10000")  # as if the server allowed less
    with page.expect_request("**/api/recognize") as req:
        page.click("#pad-recognize")
    page.wait_for_function(ERROR_OR + "document.getElementById('latex').textContent.length > 0")
    assert page.is_hidden("#error"), page.inner_text("#error")
    sent = strokes_sent(req.value)
    text = json.dumps(sent, separators=(",", ":"))
    assert raw > 30_000 and len(text) <= 10_000 and len(sent) == 4
    assert all(round(v, 1) == v for s in sent for p in s for v in p)
    assert all(len(s) >= 60 for s in sent)  # thinned, not cut short


def test_a_new_request_or_an_error_greys_or_clears_the_old_result(page, tmp_path):
    # the classes the caption result goes through, recorded as they change
    page.evaluate("""() => { window.seen = []; new MutationObserver(() => window.seen.push(
        document.getElementById('caption-result').className)).observe(document.getElementById('caption-result'),
        { attributes: true, attributeFilter: ['class'] }); }""")
    page.set_input_files("#caption-file", str(scene(tmp_path / "scene.png")))
    page.click("#caption-submit")
    page.wait_for_selector("#caption .word")
    page.click("#caption-submit")  # the same photo again: greyed while it runs, then fresh
    page.wait_for_function("window.seen.filter(c => c.includes('stale')).length >= 2 && "
                           "!document.getElementById('caption-result').classList.contains('stale')")
    assert page.is_visible("#caption-result")
    # a sample click empties the file input (it no longer holds what is captioned)
    assert page.evaluate("document.getElementById('caption-file').files.length") == 1
    page.click("#caption-samples button[data-sample='camera.jpg']")
    page.wait_for_function("document.getElementById('caption-drop-text').textContent.startsWith('camera.jpg')")
    assert page.evaluate("document.getElementById('caption-file').files.length") == 0

    page.click("#tab-math")
    page.set_input_files("#math-file", str(ROOT / "src" / "tellkit" / "assets" / "samples" / "bttr_x2_plus_1.png"))
    page.wait_for_function("document.getElementById('latex').textContent.length > 0")
    assert "bttr_x2_plus_1.png" in page.inner_text("#math-drop-text")
    page.click("#math-samples button.formula >> nth=0")  # a sample formula resets the file input
    page.wait_for_function("!document.getElementById('math-drop-text').textContent.includes('.png')")
    assert page.evaluate("document.getElementById('math-file').files.length") == 0
    page.wait_for_selector("#math-result:not(.stale)")
    page.click("#pad-clear")
    assert page.is_hidden("#math-result")
    page.evaluate("document.getElementById('math-result').hidden = false")  # as if an answer were shown
    page.click("#pad-recognize")  # nothing drawn
    assert page.inner_text("#error") == "Draw an expression first."
    assert page.is_hidden("#math-result")


def answers_with(page, path: str, extra: dict | None):
    """From now on the page sees ``extra`` added to every JSON answer from ``path`` (None: as sent)."""
    page.evaluate("""([path, extra]) => {
        window.realFetch = window.realFetch || window.fetch;
        window.fetch = !extra ? window.realFetch : async (url, opts) => {
            const res = await window.realFetch(url, opts);
            if (!String(url).endsWith(path) || !res.ok) return res;
            const body = { ...(await res.json()), ...extra };
            return new Response(JSON.stringify(body),
                                { status: res.status, headers: { "content-type": "application/json" } });
        }; }""", [path, extra])


def test_confidence_and_the_unsure_flag_are_shown_when_the_api_sends_them(page, tmp_path):
    photo = str(scene(tmp_path / "scene.png"))
    # a model without calibration whose answer is not flagged: no number, nothing shown
    answers_with(page, "/api/caption", {"confidence": None, "unsure": False})
    page.set_input_files("#caption-file", photo)
    page.click("#caption-submit")
    page.wait_for_selector("#caption .word")
    assert page.is_hidden("#caption-confidence")
    answers_with(page, "/api/caption", {"confidence": 0.23, "unsure": True})
    page.click("#caption-submit")
    page.wait_for_selector("#caption-confidence:not([hidden])")
    text = page.inner_text("#caption-confidence")
    assert "23%" in text and "unsure" in text and "unlike what the model learned" in text
    assert page.get_attribute("#caption-confidence .meter", "aria-valuenow") == "23"
    answers_with(page, "/api/caption", {"confidence": 0.91, "unsure": False})
    page.click("#caption-submit")
    page.wait_for_function("document.getElementById('caption-confidence').textContent.includes('91%')")
    assert "unsure" not in page.inner_text("#caption-confidence")
    page.screenshot(path=str(artifact_dir() / "web_e2e_confidence.png"), full_page=True)

    page.click("#tab-math")
    answers_with(page, "/api/recognize", {"confidence": 0.05, "unsure": True})
    page.click("#math-samples button.formula >> nth=2")
    page.wait_for_selector("#math-confidence:not([hidden])")
    assert "5%" in page.inner_text("#math-confidence") and "unsure" in page.inner_text("#math-confidence")
    answers_with(page, "/api/recognize", {"confidence": None, "unsure": False})
    page.click("#math-samples button.formula >> nth=3")
    page.wait_for_function("!document.getElementById('math-result').classList.contains('stale')")
    page.wait_for_selector("#math-confidence", state="hidden")


def test_favicon(page, server):
    assert page.evaluate("document.querySelector('link[rel=icon]').getAttribute('href')") == "/static/favicon.svg"
    for path, kind in (("/static/favicon.svg", "image/svg+xml"), ("/favicon.ico", "image/x-icon")):
        res = page.request.get(server.url + path)
        assert res.status == 200 and res.headers["content-type"].startswith(kind), (path, res.status)
