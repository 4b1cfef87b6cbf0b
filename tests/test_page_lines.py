"""`tellkit recognize --lines`: the lines of a page made by stacking single-line renders are found
where they were put (a fraction, with empty rows of its own, stays one line) and read as the
single renders are."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tellkit.data.inkml import RenderConfig, read_inkml, render_strokes
from tellkit.data.page_lines import find_lines
from tellkit.errors import TellkitError

SAMPLES = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "samples"
# the packaged model's renders (its data.render): the lines read as it was trained to read them
NAMES = ["bttr_x2_plus_1", "bttr_frac_a_b", "bttr_sqrt_x_plus_1", "bttr_y_eq_2x_plus_3"]


def _renders() -> list[Image.Image]:
    config = RenderConfig(stroke_size=22, line_width=2.0, margin=4)
    return [render_strokes(read_inkml(SAMPLES / f"{n}.inkml").strokes, config) for n in NAMES]


def _ink_rows(im: Image.Image) -> tuple[int, int]:
    rows = np.flatnonzero((np.asarray(im) < 128).any(axis=1))
    return int(rows[0]), int(rows[-1]) + 1


def stack(lines: list[Image.Image], gap: int = 30, indent: tuple[int, ...] = (0, 40, 10, 25)) -> tuple[Image.Image,
                                                                                                           list]:
    """A page: the renders one under the other, ``gap`` white rows apart, indented differently;
    and where each one's ink lies (top, bottom rows)."""
    width = max(im.size[0] + x for im, x in zip(lines, indent)) + 20
    height = sum(im.size[1] for im in lines) + gap * (len(lines) + 1)
    page = Image.new("L", (width, height), 255)
    y, where = gap, []
    for im, x in zip(lines, indent):
        page.paste(im, (x + 10, y))
        top, bottom = _ink_rows(im)
        where.append((y + top, y + bottom))
        y += im.size[1] + gap
    return page, where


def test_the_lines_of_a_stacked_page_are_found_where_they_were_put():
    renders = _renders()
    assert len(set(np.flatnonzero((np.asarray(renders[1]) < 128).any(axis=1)).tolist())) < renders[1].size[1] - 8
    page, where = stack(renders)
    assert [(b.top, b.bottom) for b in find_lines(np.asarray(page))] == where
    # a fraction's own empty rows do not split it: its render alone is one line
    frac = np.asarray(renders[1])
    inked = (frac < 128).any(axis=1)
    assert (~inked[_ink_rows(renders[1])[0]:_ink_rows(renders[1])[1]]).any()  # it has empty rows inside
    assert len(find_lines(frac)) == 1
    # light ink on a dark page, and specks of dust, change nothing
    dark = 255 - np.asarray(page)
    dusty = np.asarray(page).copy()
    dusty[5, 5] = dusty[-3, 7] = 0
    assert find_lines(dark) == find_lines(np.asarray(page)) == find_lines(dusty)
    with pytest.raises(TellkitError, match="no ink found"):
        find_lines(np.full((40, 60), 255, np.uint8))


@pytest.mark.slow
def test_recognize_lines_reads_each_line_as_its_single_render(tmp_path, capsys):
    from tellkit.cli import main
    from tellkit.pipelines.recognition import RecognitionPipeline

    renders = _renders()
    page, _ = stack(renders)
    page.save(tmp_path / "page.png")
    singles = []
    for i, im in enumerate(renders):
        im.save(tmp_path / f"line{i}.png")
        singles.append(str(tmp_path / f"line{i}.png"))
    pipe = RecognitionPipeline.load()
    alone = [r["text"] for r in pipe(singles)]
    got = pipe.read_page(tmp_path / "page.png")
    assert [r["text"] for r in got] == alone and [r["line"] for r in got] == [1, 2, 3, 4]
    assert "x ^ { 2 } + 1" in alone  # the packaged model reads the sample it ships
    assert main(["recognize", "--lines", str(tmp_path / "page.png")]) == 0
    assert capsys.readouterr().out.splitlines() == alone
    assert main(["recognize", "--lines", "--json", str(tmp_path / "page.png")]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["line"], r["text"]) for r in rows] == list(enumerate(alone, 1))
    assert all(r["input"] == str(tmp_path / "page.png") and r["top"] < r["bottom"] for r in rows)
    (tmp_path / "formula.inkml").write_text((SAMPLES / "bttr_x2_plus_1.inkml").read_text())
    assert main(["recognize", "--lines", str(tmp_path / "formula.inkml")]) == 2
