"""tellkit.utils.images: the safe decoder for untrusted images (bombs, formats, broken files,
orientation, transparency, high bit depth, shrinking while decoding) and its peak memory."""
import io
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from tellkit.errors import TellkitError
from tellkit.utils.images import ImageError, decode_image, open_image


def encode(im, fmt="PNG", **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` 8-bit gray pixels, with almost no data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 1024))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


def photo(w=90, h=60) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    return Image.fromarray(np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], -1).astype(np.uint8))


def test_decompression_bomb_is_refused_from_the_header():
    data = bomb_png(100_000, 100_000)  # 10 G pixels declared in ~1 KB
    assert len(data) < 2_000
    with pytest.raises(ImageError, match=r"10,000,000,000 pixels.* over the limit of 16,000,000") as e:
        open_image(data, max_pixels=16_000_000)
    assert e.value.reason == "too many pixels" and isinstance(e.value, TellkitError)
    assert "\n" not in str(e.value)
    with pytest.raises(ImageError, match=r"5000x5000 = 25,000,000 pixels, over the limit of 16,000,000"):
        open_image(bomb_png(5000, 5000), max_pixels=16_000_000)


def test_pixel_cap_from_the_environment(monkeypatch):
    data = encode(photo(100, 100))
    monkeypatch.setenv("TELLKIT_MAX_IMAGE_PIXELS", "5000")
    with pytest.raises(ImageError, match="over the limit of 5,000"):
        open_image(data)
    assert open_image(data, max_pixels=10_000).size == (100, 100)  # the argument wins
    monkeypatch.setenv("TELLKIT_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(TellkitError, match="must be an integer"):
        open_image(data)


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"certainly not an image", "not an image"),
    (encode(photo())[:120], "corrupt or truncated"),
    (encode(photo(), "TIFF"), "unsupported format"),
    (encode(photo(4, 4)), "too small"),
])
def test_bad_bytes_give_one_line_errors(data, reason):
    with pytest.raises(ImageError) as e:
        open_image(data, formats=("PNG", "JPEG"), min_side=8)
    assert e.value.reason == reason and "\n" not in str(e.value)


def test_eps_is_never_handed_to_ghostscript():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(ImageError) as e:
        open_image(eps)
    assert e.value.reason in ("unsupported format", "not an image")


def test_paths(tmp_path):
    with pytest.raises(ImageError, match="image not found") as e:
        open_image(tmp_path / "missing.png")
    assert e.value.reason == "not found"
    with pytest.raises(ImageError, match="is a directory") as e:
        open_image(tmp_path)
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageError, match="empty.png: the image file is empty"):
        open_image(tmp_path / "empty.png")
    (tmp_path / "ok.png").write_bytes(encode(photo()))
    assert open_image(tmp_path / "ok.png").size == (90, 60)
    assert open_image(str(tmp_path / "ok.png"), mode="L").mode == "L"
    with open(tmp_path / "ok.png", "rb") as f:  # a binary file object
        assert open_image(f).size == (90, 60)


def test_same_pixels_as_a_plain_decode():
    im = photo()
    out = open_image(encode(im))
    assert out.mode == "RGB" and np.array_equal(np.asarray(out), np.asarray(im))


def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (20, 20), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 10, 20))
    a = np.asarray(open_image(encode(rgba)))
    assert (a[:, :10] == [0, 0, 255]).all() and (a[:, 10:] == 255).all()
    pal = rgba.convert("P")  # palette with a transparent index
    assert open_image(encode(pal)).mode == "RGB"


def test_16_bit_gray_is_rescaled_to_8_bits_as_preprocess_does():
    from tellkit.encoders.preprocess import to_rgb

    a = (np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) * 13 + 1000).astype(np.uint16)
    data = encode(Image.fromarray(a))
    ours = np.asarray(open_image(data)).astype(int)
    ref = np.asarray(to_rgb(Image.open(io.BytesIO(data)))).astype(int)
    assert np.abs(ours - ref).max() <= 1 and ours.min() == 0 and ours.max() == 255
    flat = encode(Image.fromarray(np.full((20, 20), 700, np.uint16)))
    assert np.asarray(open_image(flat, mode="L")).max() == 0


def test_exif_orientation_is_applied_and_the_upright_size_reported():
    im = photo(90, 60)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(im, "JPEG", exif=exif.tobytes(), quality=95)
    out = decode_image(data)
    assert out.image.size == (60, 90) and out.original_size == (60, 90) and not out.resized
    small = decode_image(data, max_side=45)
    assert small.image.size == (30, 45) and small.original_size == (60, 90) and small.resized


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_max_side_shrinks_while_decoding_and_never_enlarges(fmt):
    im = photo(1000, 400)
    data = encode(im, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    out = decode_image(data, max_side=300)
    assert out.image.size == (300, 120) and out.original_size == (1000, 400) and out.format == fmt
    ref = np.asarray(im.resize((300, 120), Image.BILINEAR)).astype(int)
    assert np.abs(np.asarray(out.image).astype(int) - ref).mean() < 4  # box+bilinear (JPEG: DCT draft)
    assert decode_image(data, max_side=2000).image.size == (1000, 400)


def test_animated_gif_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
    b = io.BytesIO()
    frames[0].save(b, "GIF", save_all=True, append_images=frames[1:])
    assert np.asarray(open_image(b.getvalue()))[0, 0].tolist() == [255, 0, 0]


PROBE = r"""
import io, resource, sys
import numpy as np
from PIL import Image
from tellkit.utils.images import open_image

a = np.zeros((4000, 4000), np.uint16)
a[::7, ::5] = 60000
b = io.BytesIO()
Image.fromarray(a).save(b, "PNG")
data = b.getvalue()
del a
small = io.BytesIO()
Image.fromarray(np.arange(256, dtype=np.uint16).reshape(16, 16)).save(small, "PNG")
open_image(small.getvalue(), max_side=8)  # first-call allocations, not counted
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
img = open_image(data, max_pixels=16_000_000, max_side=int(sys.argv[1]))
print(img.size[0], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_peak_memory_of_a_16_bit_16_megapixel_png():
    """The same file cost ~321 MiB through float64 copies; the bitmap itself is 32 MB."""
    out = subprocess.run([sys.executable, "-c", PROBE, "1600"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    side, grew_mib = map(int, out.stdout.split())
    assert side == 1600 and grew_mib < 110, grew_mib
