"""Reading InkML folders with several processes, and planning batches from the renderer's
layout without drawing."""
import random

import numpy as np
import pytest

from tellkit.data.inkml import RenderConfig, image_to_tensor, read_inkml, render_strokes, rendered_shape, scan_folder

NS = "http://www.w3.org/2003/InkML"


def inkml(strokes, truth):
    traces = "".join(f'<trace id="{i}">{", ".join(f"{x} {y}" for x, y in s)}</trace>' for i, s in enumerate(strokes))
    return (f'<ink xmlns="{NS}"><annotation type="truth">{truth}</annotation>{traces}</ink>')


def test_scan_folder_reads_alike_with_several_processes(tmp_path):
    for i in range(30):
        (tmp_path / f"e{i:02d}.inkml").write_text(inkml([[(0, 0), (10 + i, 5)], [(3, 0), (3, 7 + i)]], f"x^{i}"))
    (tmp_path / "bad.inkml").write_text("<ink")
    (tmp_path / "empty.inkml").write_text("")
    one, several = scan_folder(tmp_path, workers=1), scan_folder(tmp_path, workers=2)
    assert [e.id for e in one.expressions] == [e.id for e in several.expressions] and len(one.expressions) == 30
    assert one.skipped == several.skipped == {"malformed XML": 1, "empty file": 1}
    assert one.skipped_files == several.skipped_files
    for a, b in zip(one.expressions, several.expressions):
        assert a.truth == b.truth and all(np.array_equal(p, q) for p, q in zip(a.strokes, b.strokes))


@pytest.mark.data
def test_rendered_shape_is_the_shape_of_the_render(shared_data):
    """Batches are planned from sizes computed without drawing: they must be the drawn ones."""
    files = sorted((shared_data / "crohme_inkml" / "train").rglob("*.inkml"))
    exprs = [read_inkml(f) for f in random.Random(0).sample(files, 80) if f.stat().st_size]
    for cfg in (RenderConfig(stroke_size=16, line_width=2), RenderConfig(stroke_size=22, line_width=2),
                RenderConfig(stroke_size=64, max_pixels=60_000), RenderConfig(stroke_size=40, max_side=300)):
        for e in exprs:
            assert rendered_shape(e.strokes, cfg) == tuple(image_to_tensor(render_strokes(e.strokes, cfg)).shape[-2:])


def test_extra_training_folders_join_the_training_split_only(tmp_path):
    from tellkit.config import deep_merge, load_yaml, resolve_config_path
    from tellkit.errors import TellkitError
    from tellkit.tasks import make_task

    for folder, n in (("root/train/a", 5), ("root/test/2014", 3), ("more/writers", 4)):
        (tmp_path / folder).mkdir(parents=True)
        for i in range(n):
            (tmp_path / folder / f"e{i}.inkml").write_text(inkml([[(0, 0), (10 + i, 5)], [(3, 0), (3, 7)]], "x"))
    recipe = deep_merge(load_yaml(resolve_config_path("bttr/tiny")),
                        {"data": {"root": str(tmp_path / "root"), "limit": {}, "cache": None,
                                  "extra_train": [str(tmp_path / "more" / "writers")]}})
    task = make_task(recipe)
    assert len(task.build_dataset("train")) == 9 and len(task.build_dataset("val")) == 3
    relative = make_task(deep_merge(recipe, {"data": {"extra_train": ["../more/writers"]}}))
    assert len(relative.build_dataset("train")) == 9
    for bad in ("more/writers", [""], [3]):
        with pytest.raises(TellkitError, match="data.extra_train"):
            make_task(deep_merge(recipe, {"data": {"extra_train": bad}}))
