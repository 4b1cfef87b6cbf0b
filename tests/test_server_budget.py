"""Issue 39 on the server side: bounded work per request (a memory budget shared by the model
workers, admission by the measured speed with 503 + Retry-After, cheap requests not stuck behind
expensive ones, an input prepared once), no client starving the others (a request takes a place
only once its body is in; a slow body is cut by a minimum rate), the strokes field's own limits,
and HTTP versions. Stub models and a real socket on 127.0.0.1: seconds."""
from __future__ import annotations

import io
import json
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")

from tellkit.pipelines.recognition import recognition_cost  # noqa: E402
from tellkit.server.app import create_app, parse_strokes  # noqa: E402
from tellkit.server.batching import BatchWorker, MemoryBudget, QueueFull  # noqa: E402
from tellkit.server.budget import PrepareOnce  # noqa: E402
from tellkit.server.limits import Limits, RequestError  # noqa: E402
from tellkit.server.runner import ServerThread, encode_multipart, post  # noqa: E402


class Echo:
    """A math model that answers at once (or after ``delay`` s a batch)."""

    info = {"name": "stub-math", "trained": False, "checkpoint": None}
    task, api_text = "recognize", "latex"

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def __call__(self, items):
        time.sleep(self.delay)
        return [{"text": "x", "tokens": ["x"], "score": 0.0} for _ in items]

    def recognize(self, items):
        return [{"latex": r["text"], **{k: v for k, v in r.items() if k != "text"}} for r in self(items)]


def png(w=64, h=48) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 255, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wait(pred, timeout=10.0):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(0.01)


# --- the batching worker -----------------------------------------------------------------------------
def test_batches_hold_at_most_the_memory_budget_and_a_large_item_runs_alone():
    seen, gate, entered = [], threading.Event(), threading.Event()

    def fn(items):
        entered.set()
        gate.wait(5)
        seen.append(list(items))
        return items

    budget = MemoryBudget(100)
    w = BatchWorker("t", fn, max_batch=8, max_wait_s=0.05, budget=budget)
    try:
        futs = [w.submit("first", cost=10)]  # holds the worker while the rest queue up
        assert entered.wait(5)
        futs += [w.submit(f"s{i}", cost=30) for i in range(4)] + [w.submit("big", cost=500)]
        gate.set()
        assert [f.result(5) for f in futs] == ["first", "s0", "s1", "s2", "s3", "big"]
    finally:
        w.close()
    assert seen == [["first"], ["s0", "s1", "s2"], ["s3"], ["big"]]
    assert budget.used == 0 and budget.peak == 500


def test_workers_sharing_a_budget_never_run_over_it_together_and_take_turns():
    budget, running, most, calls = MemoryBudget(100), [0], [0], []
    lock = threading.Lock()

    def model(name):
        def fn(items):
            with lock:
                running[0] += 60
                most[0] = max(most[0], running[0])
                calls.append(name)
            time.sleep(0.05)
            with lock:
                running[0] -= 60
            return items
        return fn

    a, b = BatchWorker("a", model("a"), max_batch=1, budget=budget), BatchWorker("b", model("b"), max_batch=1,
                                                                                  budget=budget)
    try:
        futs = [w.submit(i, cost=60) for i in range(4) for w in (a, b)]
        [f.result(10) for f in futs]
    finally:
        a.close()
        b.close()
    assert most[0] == 60
    assert calls in (["a", "b"] * 4, ["b", "a"] * 4), calls  # neither worker starves the other


def test_a_small_item_runs_beside_a_large_one_on_the_small_lane():
    gate, entered, done = threading.Event(), threading.Event(), []

    def fn(items):
        if "large" in items:
            entered.set()
            gate.wait(5)
        done.extend(items)
        return items

    w = BatchWorker("t", fn, max_batch=4, budget=MemoryBudget(100), small_lane_bytes=25)
    try:
        large = w.submit("large", cost=70)
        assert entered.wait(5)
        assert w.submit("small", cost=20).result(5) == "small"  # answered while the large one runs
        assert not large.done() and done == ["small"]
        big2 = w.submit("large2", cost=40)  # not for the small lane: waits for the first
        time.sleep(0.2)
        assert not big2.done()
        gate.set()
        assert large.result(5) == "large" and big2.result(5) == "large2"
    finally:
        w.close()


def test_a_cheap_item_is_not_stuck_behind_expensive_ones():
    order, gate, entered = [], threading.Event(), threading.Event()
    gate.set()

    def fn(items):
        entered.set()
        gate.wait(5)
        order.extend(items)
        time.sleep(0.02)
        return items

    w = BatchWorker("t", fn, max_batch=1)
    try:
        w.submit("warm", work=1.0).result(10)  # the worker learns its speed (seconds per unit of work)
        gate.clear()
        entered.clear()
        order.clear()
        futs = [w.submit("hold", work=1.0)]
        assert entered.wait(5)
        futs += [w.submit(f"big{i}", work=500.0) for i in range(3)] + [w.submit("small", work=1.0)]
        gate.set()
        [f.result(10) for f in futs]
    finally:
        w.close()
    assert order.index("small") == 1, order


def test_work_that_cannot_finish_in_time_is_refused_with_a_retry_time():
    w = BatchWorker("t", lambda items: (time.sleep(0.2), items)[1], max_batch=1)
    try:
        w.submit("warm", work=1.0).result(10)  # ~0.2 s per unit
        futs = [w.submit(i, work=1.0, deadline_s=5.0) for i in range(3)]
        with pytest.raises(QueueFull) as exc:
            w.submit("late", work=30.0, deadline_s=5.0)  # ~6 s of work alone
        assert exc.value.retry_after >= 1 and "the 5 s a request may take" in str(exc.value)
        [f.result(10) for f in futs]
        assert w.snapshot()["refused_busy"] == 1
    finally:
        w.close()


def test_the_worker_refuses_past_its_queue_with_a_retry_time():
    gate, entered = threading.Event(), threading.Event()
    w = BatchWorker("t", lambda items: (entered.set(), gate.wait(5), items)[2], max_batch=1, max_queue=2)
    try:
        futs = [w.submit(0)]
        assert entered.wait(5)
        futs += [w.submit(1), w.submit(2)]
        with pytest.raises(QueueFull) as exc:
            w.submit(3)
        assert exc.value.retry_after >= 1
        gate.set()
        [f.result(5) for f in futs]
    finally:
        w.close()


# --- what a search costs ------------------------------------------------------------------------------
def test_a_search_costs_more_on_a_larger_grid_and_an_unprepared_input_costs_the_worst_case():
    torch = pytest.importorskip("torch")

    class Cfg:
        d_model, num_decoder_layers = 256, 3

    class Net:
        config = Cfg()

    class Gen:
        beam_size, max_len = 10, 200

    class Model:
        generation, model = Gen(), Net()

    small = recognition_cost(Model(), torch.zeros(1, 64, 96))
    noise = recognition_cost(Model(), torch.zeros(1, 576, 576))
    worst = recognition_cost(Model(), None)
    assert small.bytes < 60 << 20 < 100 << 20 < noise.bytes == worst.bytes < 200 << 20
    assert small.work < noise.work
    # measured: one such search grows the peak by 96 MiB; its encoder alone by 79 MiB
    assert noise.bytes > (96 << 20)


def test_an_input_is_prepared_once_when_the_server_prepared_it():
    calls = []

    class Owner:
        def prepare(self, item):
            calls.append(id(item))
            return f"prepared {item}"

    class Item:
        pass

    owner, a, b = Owner(), Item(), Item()
    once = PrepareOnce(owner)
    assert once.early(a) == f"prepared {a}" and once.pending() == 1
    assert owner.prepare(a) == f"prepared {a}" and owner.prepare(b) == f"prepared {b}"
    assert calls == [id(a), id(b)] and once.pending() == 0
    once.early(b)
    del b  # an item nobody asked for again: its result goes with it
    assert once.pending() == 0


# --- strokes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, status, needle", [
    ("[[[1" + "0" * 400 + ", 2]]]", 422, "at most 1e+09"),
    ("[[[NaN, 2]]]", 422, "finite numbers"),
    ("[[[Infinity, 2]]]", 422, "finite numbers"),
    ("[[[1e400, 2]]]", 422, "at most 1e+09"),
    ("[[[true, 2]]]", 422, "at most 1e+09"),
    ("[" + "[[1, 2]]," * 2_000 + "[[1, 2]]]", 422, "1 to 2,000 strokes"),
    ("[[" + "[1, 2]," * 100_000 + "[1, 2]]]", 413, "100,000 points"),
])
def test_hostile_strokes_are_refused(text, status, needle):
    with pytest.raises(RequestError) as exc:
        parse_strokes(text)
    assert (exc.value.status, needle in exc.value.message) == (status, True), exc.value.message


def test_a_drawing_at_full_javascript_precision_fits_the_documented_limits():
    rng = np.random.default_rng(0)
    # 2,000 strokes, 100,000 points, each coordinate with 17 significant digits (~40 characters a point)
    strokes = [[[float(x), float(y)] for x, y in rng.random((50, 2)) * 600 + 0.123456789012345] for _ in range(2_000)]
    text = json.dumps(strokes, separators=(",", ":"))  # as the page's JSON.stringify writes it
    assert 3_500_000 < len(text) <= Limits().max_stroke_chars
    out = parse_strokes(text)
    assert len(out) == 2_000 and sum(map(len, out)) == 100_000 and out[0][0] == tuple(strokes[0][0])


@pytest.fixture()
def server():
    limits = Limits(max_inflight=2, header_timeout_s=2.0, body_idle_timeout_s=3.0, body_grace_s=0.5,
                    min_body_rate=2_000, max_stroke_chars=30_000)
    with ServerThread(create_app({"recognize": Echo()}, limits, serve_page=False)) as srv:
        yield srv


def test_strokes_have_their_own_character_limit(server):
    pad = json.dumps([[[123.45678901234567, 456.7890123456789]] * 600])  # 600 points at full precision: 24k
    assert 20_000 < len(pad) < 30_000
    s, b = post(server.url + "/api/recognize", fields={"strokes": pad})
    assert s == 200, b
    s, b = post(server.url + "/api/recognize", fields={"strokes": json.dumps([[[1.5, 2.5]] * 3_000])})
    assert (s, b["error"]) == (413, "field_too_long") and "'strokes'" in b["detail"] and "30,000" in b["detail"]
    s, b = post(server.url + "/api/recognize", fields={"strokes": "[[[1" + "0" * 400 + ", 2]]]"})
    assert (s, b["error"]) == (422, "bad_input")


# --- slow clients, HTTP versions ----------------------------------------------------------------------
def _slow(url: str, n: int) -> list[socket.socket]:
    host, port = url.split("//")[1].split(":")
    head = (b"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 100000\r\n\r\n-")
    out = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(head)
        out.append(s)
    return out


def _answer(s: socket.socket) -> bytes:
    got = b""
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not part:
            break
        got += part
    return got


def test_slow_uploads_take_no_place_of_ready_requests_and_are_cut_by_the_minimum_rate(server):
    slow = _slow(server.url, 6)  # three times max_inflight
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        s, b = post(server.url + "/api/recognize", files={"image": ("a.png", png(), "image/png")})
        assert s == 200 and time.monotonic() - t0 < 2.0, b
        t0 = time.monotonic()
        answers = [_answer(c) for c in slow]
        assert time.monotonic() - t0 < 3.0  # grace 0.5 s + 1 byte / 2,000 bytes/s
        for a in answers:
            assert a.startswith(b"HTTP/1.1 408") and b"bytes/s" in a, a[:300]
    finally:
        for c in slow:
            c.close()


def test_busy_answers_carry_retry_after():
    app = create_app({"recognize": Echo(delay=1.0)}, Limits(max_inflight=1), max_batch=1, serve_page=False)
    with ServerThread(app) as srv:
        first = threading.Thread(target=post, args=(srv.url + "/api/recognize",),
                                 kwargs={"files": {"image": ("a.png", png(), "image/png")}})
        first.start()
        time.sleep(0.4)
        data, ctype = encode_multipart(files={"image": ("a.png", png(), "image/png")})
        host, port = srv.url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(f"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            answer = _answer(c)
        first.join(10)
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 503") and b"retry-after: 2" in head, answer[:400]


@pytest.mark.parametrize("version", [b"HTTP/9.9", b"HTTP/2.0"])
def test_http_versions_other_than_1_0_and_1_1_are_refused(server, version):
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as c:
        c.sendall(b"GET /health " + version + b"\r\nHost: x\r\n\r\n")
        answer = _answer(c)
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.split(b" ")[1] in (b"400", b"505"), answer[:200]


# --- the inputs' memory --------------------------------------------------------------------------------
def test_an_input_hold_takes_and_gives_back_by_part():
    from tellkit.server.budget import InputBudget, InputHold

    budget = InputBudget(100)
    a = InputHold(budget, lambda what, n: RequestError(503, "busy", f"{what} {n}"))
    a.need(60, "image")
    a.need(10, "article")
    assert budget.used == 70
    with pytest.raises(RequestError, match="image 200"), InputHold(budget, a.refuse) as b:
        b.need(200, "image")  # over the budget while another holds some
    a.need(20, "image")  # the full-size bitmap has gone: the rest given back
    assert budget.used == 30 and budget.peak == 70
    a.close()
    with InputHold(budget, a.refuse) as alone:
        alone.need(500, "drawing")  # larger than the budget, admitted when nothing else is held
        assert budget.used == 500
    assert budget.used == 0


def test_strokes_estimates_cover_what_parsing_takes():
    import tracemalloc

    from tellkit.server.budget import strokes_kept_bytes, strokes_parse_bytes

    points = json.dumps([[[float(i), float(j)] for j in range(50)] for i in range(200)])
    for text in (points, "[" + ",".join(["[]"] * 50_000) + "]", "[" + ",".join(["0"] * 50_000) + "]"):
        tracemalloc.start()
        try:
            json.loads(text, parse_int=float)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= strokes_parse_bytes(text) <= 3 * peak + len(text), (text[:20], peak)
    tracemalloc.start()
    try:
        kept = parse_strokes(points)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used <= strokes_kept_bytes(kept) <= 2 * used


def _post_headers(url: str, files=None, fields=None):
    import http.client

    body, ctype = encode_multipart(fields, files)
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/api/recognize", body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def test_decoded_inputs_count_against_the_input_budget():
    """A 1000 x 1000 upload takes 7 MiB while it is decoded and keeps 3 MiB while its request
    runs: with an 8 MiB budget a second upload (or a 100,000-point drawing) arriving meanwhile
    gets 503 with Retry-After before it is decoded or parsed; once the first is answered the
    budget is whole again and the next one is served."""
    app = create_app({"recognize": Echo(delay=1.5)}, Limits(input_budget_mb=8), max_batch=1, serve_page=False)
    big = png(1000, 1000)
    drawing = json.dumps([[[float(i), float(j)] for j in range(50)] for i in range(2_000)])
    with ServerThread(app) as srv:
        first = []
        t = threading.Thread(target=lambda: first.append(post(srv.url + "/api/recognize",
                                                              files={"image": ("a.png", big, "image/png")})))
        t.start()
        _wait(lambda: app.state.inputs.used > 0)
        assert app.state.inputs.used >= 3 * 1000 * 1000
        for kw, what in (({"files": {"image": ("b.png", big, "image/png")}}, "image"),
                         ({"fields": {"strokes": drawing}}, "drawing")):
            status, headers, body = _post_headers(srv.url, **kw)
            assert (status, body["error"]) == (503, "busy") and headers.get("retry-after") == "2", body
            assert f"this {what} needs" in body["detail"] and "\n" not in body["detail"], body
        t.join(30)
        assert first and first[0][0] == 200, first
        assert app.state.inputs.used == 0 and app.state.inputs.peak >= 7 * 1000 * 1000
        s, body = post(srv.url + "/api/recognize", files={"image": ("c.png", big, "image/png")})
        assert s == 200, body
        s, body = post(srv.url + "/api/recognize", fields={"strokes": "[[[0,0],[1,"})  # refused by the parser
        assert s == 422 and app.state.inputs.used == 0
        health = json.loads(urllib.request.urlopen(srv.url + "/health", timeout=10).read())
        assert health["input_budget"]["total_mib"] == 8 and health["input_budget"]["used_mib"] == 0


# --- memory given back after a burst ---------------------------------------------------------------
class _Input:
    """An input whose death a weak reference can see."""


def test_idle_threads_keep_nothing_of_the_last_job_or_batch():
    import gc
    import weakref

    from tellkit.server.batching import PriorityPool

    pool = PriorityPool(1, "t")
    w = BatchWorker("t", lambda items: [type(x).__name__ for x in items], max_batch=2, max_wait_s=0.01)
    try:
        a, b = _Input(), _Input()
        ra, rb = weakref.ref(a), weakref.ref(b)
        assert pool.submit(lambda x: x, a).result(5) is a  # the future's result is the input itself
        assert w.submit(b).result(5) == "_Input"
        del a, b
        deadline = time.monotonic() + 5
        while (ra() is not None or rb() is not None) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.02)
        assert ra() is None, "the pool's idle thread still holds the last job's argument or result"
        assert rb() is None, "the batch worker's idle thread still holds the last batch"
    finally:
        pool.shutdown()
        w.close()


def test_memory_is_given_back_once_the_api_has_been_quiet(monkeypatch):
    import asyncio

    from tellkit.server import body_guard

    calls = []
    monkeypatch.setattr(body_guard, "release_memory", lambda: calls.append(time.monotonic()))
    counters = {"inflight": 0, "receiving": 0, "buffered": 0}

    async def scenario():
        idle = body_guard.IdleRelease(counters, quiet_s=0.2)
        counters["inflight"] = 1  # a request still running: no trim, however long
        idle.poke()
        await asyncio.sleep(0.5)
        assert calls == []
        counters["inflight"] = 0
        t0 = time.monotonic()
        idle.poke()
        await asyncio.sleep(0.1)
        idle.poke()  # another request ended: the quiet period starts again
        for _ in range(100):  # the collection before the trim may take a while on a loaded machine
            if calls:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert len(calls) == 1 and calls[0] - t0 >= 0.28  # once, a quiet period after the last poke
        idle.close()

    asyncio.run(scenario())
