"""Image decoding bounded in work, not only in pixels: a JPEG's scans, a PNG's chunks and an
animation's frames are counted before decoding and refused past their limits, in the library, the
CLI (exit 2, one line) and the server (422 image_too_complex)."""
from __future__ import annotations

import io
import re
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from tellkit.utils import image_structure as st
from tellkit.utils.images import ImageError, decode_image

_NEXT = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def progressive_jpeg(side: int = 1000) -> bytes:
    x = np.linspace(0, 255, side, dtype=np.float32)
    img = Image.fromarray(np.stack([np.add.outer(x, x) / 2] * 3, -1).astype(np.uint8))
    b = io.BytesIO()
    img.save(b, "JPEG", progressive=True, quality=90)
    return b.getvalue()


def scan_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every scan (its SOS segment and entropy-coded data), walked by hand here."""
    out, pos = [], 2
    while data[pos + 1] != 0xD9:
        length = (data[pos + 2] << 8) | data[pos + 3]
        if data[pos + 1] == 0xDA:
            end = _NEXT.search(data, pos + 2 + length).start()
            out.append((pos, end))
            pos = end
        else:
            pos += 2 + length
    return out


def scan_bomb(repeats: int = 25_000, side: int = 1000) -> bytes:
    """A progressive JPEG whose smallest scan is repeated ``repeats`` times."""
    data = progressive_jpeg(side)
    start, end = min(scan_spans(data), key=lambda s: s[1] - s[0])
    return data[:end] + data[start:end] * repeats + data[end:]


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_split_idat(pieces: int) -> bytes:
    """A 64x64 gray PNG whose image data is split into ``pieces`` IDAT chunks."""
    raw = b"".join(b"\0" + bytes(range(64)) for _ in range(64))
    z = zlib.compress(raw)
    step = max(1, -(-len(z) // pieces))
    parts = [z[i:i + step] for i in range(0, len(z), step)]
    parts += [b""] * (pieces - len(parts))
    ihdr = struct.pack(">IIBBBBB", 64, 64, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + b"".join(png_chunk(b"IDAT", p) for p in parts)
            + png_chunk(b"IEND", b""))


def gif_frames(n: int) -> bytes:
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 255, (4, 4), dtype=np.uint8), "L") for _ in range(n)]
    b = io.BytesIO()
    frames[0].save(b, "GIF", save_all=True, append_images=frames[1:], duration=10)
    return b.getvalue()


def test_a_normal_progressive_jpeg_is_read_and_counted():
    data = progressive_jpeg(200)
    s = st.count_structure(data)
    assert s.format == "JPEG" and s.scans == len(scan_spans(data)) and 2 <= s.scans <= 20
    assert decode_image(data).image.size == (200, 200)


def test_the_scan_bomb_is_refused_within_10_seconds():
    bomb = scan_bomb()
    t0 = time.monotonic()
    with pytest.raises(ImageError) as info:
        decode_image(bomb)
    assert time.monotonic() - t0 < 10
    assert info.value.reason == "too complex"
    msg = str(info.value)
    assert "more than 256 scans" in msg and "\n" not in msg
    # just under the limit is read
    ok = progressive_jpeg(200)
    start, end = min(scan_spans(ok), key=lambda s: s[1] - s[0])
    under = ok[:end] + ok[start:end] * (st.MAX_JPEG_SCANS - len(scan_spans(ok))) + ok[end:]
    assert st.count_structure(under).scans == st.MAX_JPEG_SCANS
    assert decode_image(under).image.size == (200, 200)


def test_the_walk_of_an_8_mib_upload_takes_milliseconds():
    noise = np.random.default_rng(0).integers(0, 255, (1500, 1500, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(noise).save(b, "JPEG", quality=100, progressive=True)
    data = b.getvalue() * 3  # bytes after EOI are not walked; the scans of the first image are
    t0 = time.perf_counter()
    s = st.count_structure(data)
    assert time.perf_counter() - t0 < 0.5 and s.scans >= 2


def test_png_chunks_and_gif_frames_are_bounded(tmp_path):
    assert decode_image(png_split_idat(1000), mode="L").image.size == (64, 64)
    with pytest.raises(ImageError, match="more than 65,536 chunks") as info:
        decode_image(png_split_idat(st.MAX_PNG_CHUNKS + 10), mode="L")
    assert info.value.reason == "too complex"
    assert decode_image(gif_frames(20)).image.size == (4, 4)
    with pytest.raises(ImageError, match="more than 1,024 animation frames"):
        decode_image(gif_frames(st.MAX_FRAMES + 5))
    # an APNG that declares more frames than accepted, from a path
    apng = png_split_idat(1)
    actl = png_chunk(b"acTL", struct.pack(">II", 100_000, 0))
    apng = apng[:33] + actl + apng[33:]
    path = tmp_path / "many.png"
    path.write_bytes(apng)
    with pytest.raises(ImageError, match="animation frames") as info:
        decode_image(path)
    assert str(path) in str(info.value)


def test_cli_refuses_the_scan_bomb_in_one_line(tmp_path, capsys):
    from tellkit.cli import main

    path = tmp_path / "bomb.jpg"
    path.write_bytes(scan_bomb(2000, side=400))
    t0 = time.monotonic()
    assert main(["recognize", str(path)]) == 2
    assert time.monotonic() - t0 < 60  # the model loads first; the image is refused unread
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than 256 scans" in err and str(path) in err, err


class _StubRecognizer:
    """A recognizer that answers "x" to every image (the server's limits are under test)."""
    info = {"name": "stub-math", "trained": False, "checkpoint": None}
    task, api_text = "recognize", "latex"

    def __call__(self, images):
        return [{"text": "x", "tokens": ["x"], "score": 0.0} for _ in images]


def test_server_answers_422_image_too_complex():
    pytest.importorskip("fastapi")
    pytest.importorskip("python_multipart")
    from tellkit.server.app import create_app
    from tellkit.server.limits import Limits
    from tellkit.server.runner import ServerThread, post

    app = create_app({"recognize": _StubRecognizer()}, Limits(), serve_page=False)
    with ServerThread(app) as srv:
        t0 = time.monotonic()
        s, body = post(srv.url + "/api/recognize", files={"image": ("b.jpg", scan_bomb(), "image/jpeg")})
        assert (s, body["error"]) == (422, "image_too_complex") and time.monotonic() - t0 < 10
        assert "\n" not in body["detail"]
        s, body = post(srv.url + "/api/recognize", files={"image": ("a.jpg", progressive_jpeg(100), "image/jpeg")})
        assert s == 200, body
        # four bombs at once never delay another client by more than 2 s
        import threading

        bombs = [threading.Thread(target=post, args=(srv.url + "/api/recognize",),
                                  kwargs={"files": {"image": ("b.jpg", scan_bomb(), "image/jpeg")}}) for _ in range(4)]
        for t in bombs:
            t.start()
        t0 = time.monotonic()
        s, body = post(srv.url + "/api/recognize", files={"image": ("a.jpg", progressive_jpeg(100), "image/jpeg")})
        assert s == 200 and time.monotonic() - t0 < 2, body
        for t in bombs:
            t.join(30)


def test_scans_are_bounded_by_their_work_over_the_image():
    side = 3000  # 9 M pixels: 166 scans of work accepted
    data = progressive_jpeg(side)
    spans = scan_spans(data)
    allowed = st.MAX_JPEG_SCAN_PIXELS // (side * side)
    start, end = min(spans, key=lambda s: s[1] - s[0])

    def with_scans(n):
        return data[:end] + data[start:end] * (n - len(spans)) + data[end:]

    with pytest.raises(ImageError, match="more decoding work than accepted") as info:
        decode_image(with_scans(allowed + 1), max_side=1024)
    assert info.value.reason == "too complex"
    assert decode_image(with_scans(allowed), max_side=1024).original_size == (side, side)


def slow_allowed_jpeg(side: int = 3000, max_bytes: int = 8 << 20) -> bytes:
    """A noisy progressive JPEG with as many scans as the structure limits admit at its size
    (its largest scan that keeps the file within ``max_bytes`` repeated, the server's upload
    limit by default): about the most decoding work that passes the counts."""
    noise = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(noise).save(b, "JPEG", progressive=True, quality=20)
    data = b.getvalue()
    spans = scan_spans(data)
    allowed = min(st.MAX_JPEG_SCANS, st.MAX_JPEG_SCAN_PIXELS // (side * side))
    room = (max_bytes - 4096 - len(data)) // (allowed - len(spans))
    start, end = max((s for s in spans if s[1] - s[0] <= room), key=lambda s: s[1] - s[0])
    return data[:end] + data[start:end] * (allowed - len(spans)) + data[end:]


def test_decoding_stops_at_its_time_budget():
    """An image that passes the structure limits but decodes for longer than the time budget is
    refused ("too complex") at about the budget, not after the whole decode."""
    data = slow_allowed_jpeg()
    t0 = time.perf_counter()
    assert decode_image(data, max_side=1024, time_budget_s=60).image.size == (1024, 1024)
    full = time.perf_counter() - t0
    assert full > 0.1, full  # else the image is no test of the budget
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="took longer than 0.02 s") as info:
        decode_image(data, max_side=1024, time_budget_s=0.02)
    assert info.value.reason == "too complex" and time.perf_counter() - t0 < max(0.5 * full, 0.08)


def test_server_decode_timeout_is_422_and_frees_the_decoder():
    """Past ``decode_timeout_s`` an upload gets 422 image_too_complex in one line, and the two
    decoding threads go on to a small image that arrives behind two slow ones."""
    pytest.importorskip("fastapi")
    pytest.importorskip("python_multipart")
    import threading

    from tellkit.server.app import create_app
    from tellkit.server.limits import Limits
    from tellkit.server.runner import ServerThread, post

    slow = slow_allowed_jpeg()
    app = create_app({"recognize": _StubRecognizer()}, Limits(decode_timeout_s=0.05), serve_page=False)
    with ServerThread(app) as srv:
        answers = []
        slows = [threading.Thread(target=lambda: answers.append(post(srv.url + "/api/recognize", files={
            "image": ("s.jpg", slow, "image/jpeg")}))) for _ in range(2)]
        for t in slows:
            t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        s, body = post(srv.url + "/api/recognize", files={"image": ("a.jpg", progressive_jpeg(100), "image/jpeg")})
        assert s == 200 and time.monotonic() - t0 < 2, body
        for t in slows:
            t.join(30)
    assert [(s, b["error"]) for s, b in answers] == [(422, "image_too_complex")] * 2, answers
    assert all("took longer than 0.05 s" in b["detail"] and "\n" not in b["detail"] for _, b in answers)
