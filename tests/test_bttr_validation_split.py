"""Validation on other writers: the `*_extra` recipes name a folder beside data.root
(``../crohme_extra/train``) for validation, all of it, and keep CROHME 2014 test for the test."""
from __future__ import annotations

from pathlib import Path

import pytest

from tellkit.config import deep_merge, load_yaml
from tellkit.errors import TellkitError
from tellkit.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
INK = ('<ink xmlns="http://www.w3.org/2003/InkML"><annotation type="truth">{truth}</annotation>'
       '<trace>10 10, 30 40</trace><trace>30 10, 10 40</trace></ink>')


def _folder(d: Path, truths: list[str]) -> None:
    d.mkdir(parents=True)
    for i, t in enumerate(truths):
        (d / f"e{i}.inkml").write_text(INK.format(truth=t), encoding="utf-8")


def _task(recipe: str, root: Path, **data):
    r = deep_merge(load_yaml(ROOT / "configs" / "bttr" / recipe), {"data": {"root": str(root), "cache": None, **data}})
    return get_task(r["task"])(r)


@pytest.mark.parametrize("recipe", ["crohme_cpu_extra.yaml", "crohme_aug_extra.yaml", "comer_aug_extra.yaml",
                                    "crohme_aug_extra_forest.yaml"])
def test_extra_recipes_validate_beside_root_and_test_on_2014(tmp_path, recipe):
    data = tmp_path / "somewhere"
    _folder(data / "crohme_inkml" / "train" / "S", ["x", "y", "1"])
    _folder(data / "crohme_inkml" / "test" / "2014", ["a", "b"])
    extra = [f"x_{{{i}}}" for i in range(9)]
    _folder(data / "crohme_extra" / "train" / "crohme2012_test", extra[:5])
    _folder(data / "crohme_extra" / "train" / "crohme2011_test", extra[5:])
    assert not Path(load_yaml(ROOT / "configs" / "bttr" / recipe)["data"]["val"]).is_absolute()  # portable
    task = _task(recipe, data / "crohme_inkml")
    val = task.build_dataset("val")
    assert sorted(" ".join(e.tokens) for e in val.exprs) == sorted(f"x _ {{ {i} }}" for i in range(9))
    assert sorted(" ".join(e.tokens) for e in task.build_dataset("test").exprs) == ["a", "b"]
    assert task.data.limit == {}  # all of the validation folder, not a seeded subset


def test_files_of_one_name_in_two_test_years_get_distinct_ids(tmp_path):
    """crohme_extra holds CROHME 2011 and 2012 test files of the same name: an evaluation must
    not take them for one sample evaluated twice."""
    from tellkit.data.crohme import load_split

    _folder(tmp_path / "extra" / "train" / "crohme2011_test", ["a", "b"])
    _folder(tmp_path / "extra" / "train" / "crohme2012_test", ["c"])
    ids = sorted(e.id for e in load_split(tmp_path / "extra", "train", "inkml"))
    assert ids == ["crohme2011_test/e0", "crohme2012_test/e0", "e1"]


def test_extra_recipe_without_the_folder_says_where_it_looked(tmp_path):
    _folder(tmp_path / "crohme_inkml" / "test" / "2014", ["a"])
    task = _task("crohme_cpu_extra.yaml", tmp_path / "crohme_inkml")
    with pytest.raises(TellkitError, match="crohme_extra"):
        task.build_dataset("val")
    # an absolute folder anywhere else is taken as it is
    _folder(tmp_path / "mine" / "val", ["z"])
    task = _task("crohme_cpu_extra.yaml", tmp_path / "crohme_inkml", val=str(tmp_path / "mine" / "val"))
    assert [e.tokens for e in task.build_dataset("val").exprs] == [["z"]]


def test_packaged_copies_of_the_extra_recipes_are_the_same():
    for name in ("crohme_cpu_extra.yaml", "crohme_aug_extra.yaml", "comer_aug_extra.yaml",
                 "crohme_aug_extra_forest.yaml"):
        a = (ROOT / "configs" / "bttr" / name).read_text(encoding="utf-8")
        assert a == (ROOT / "src" / "tellkit" / "configs" / "bttr" / name).read_text(encoding="utf-8")
