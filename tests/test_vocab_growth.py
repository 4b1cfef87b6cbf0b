"""A handwriting reader's vocabulary: built from the training labels and stored with the
checkpoint (data.symbols), grown by fine-tuning on new symbols (old rows kept exactly), listed
by `tellkit model-info`; the packaged default keeps CROHME's 110 symbols."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tellkit.data.latex import SYMBOLS, Vocab, grow
from tellkit.errors import TellkitError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "src" / "tellkit" / "assets" / "bttr_default"
NEW = ["\\aleph", "\\hbar", "\\nabla"]


def test_grow_keeps_the_old_ids_and_appends_the_new_symbols_sorted():
    symbols, new = grow(list(SYMBOLS), [["x", "\\nabla"], ["\\aleph", "<sos>"], ["\\hbar", "\\aleph"]])
    assert new == NEW and symbols == [*SYMBOLS, *NEW]
    old, grown = Vocab(), Vocab(symbols)
    assert all(grown.stoi[t] == i for t, i in old.stoi.items()) and len(grown) == len(old) + 3


def _shapes(root: Path) -> None:
    """Three new symbols drawn as three shapes (and a known one, "1"), four variants each."""
    from PIL import Image, ImageDraw

    (root / "train").mkdir(parents=True)
    lines = []
    for k, label in enumerate([*NEW, "1"]):
        for v in range(4):
            im = Image.new("L", (48, 48), 255)
            d = ImageDraw.Draw(im)
            if k == 0:
                d.ellipse([8 + v, 8, 40 - v, 40], outline=0, width=3)
            elif k == 1:
                d.line([(6, 8 + v), (42, 40 - v)], fill=0, width=3)
                d.line([(6, 40 - v), (42, 8 + v)], fill=0, width=3)
            elif k == 2:
                d.polygon([(24, 6 + v), (42, 40), (6, 40)], outline=0, width=3)
            else:
                d.line([(24, 6), (24, 42 - v)], fill=0, width=3)
            im.save(root / "train" / f"s{k}_{v}.png")
            lines.append(f"s{k}_{v}\t{label}")
    (root / "train" / "caption.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _base(folder: Path) -> Path:
    from tellkit.registry import create_model

    torch.manual_seed(0)
    return create_model("bttr/tiny").save_pretrained(folder, extra={"task": "recognize", "data": {"cache": None}})


def _recipe(data: Path, init: Path, *more: str) -> list[str]:
    return [f"data.root={data}", "data.layout=caption", "data.train=train", "data.val=train", "data.test=train",
            "data.scale=1.0", "data.limit.test=null", f"train.init_from={init}", *more]


def _task(overrides: list[str]):
    from tellkit.config import deep_merge, load_yaml, parse_overrides, resolve_config_path
    from tellkit.tasks import make_task

    return make_task(deep_merge(load_yaml(resolve_config_path("configs/bttr/tiny.yaml")), parse_overrides(overrides)))


def test_a_grown_model_keeps_the_checkpoints_rows_exactly_and_says_how_many_it_added(tmp_path, capsys):
    from tellkit.checkpoint import load_model, load_weights_into

    _shapes(tmp_path / "data")
    base = _base(tmp_path / "base")
    task = _task(_recipe(tmp_path / "data", base))
    model = task.build_model()
    assert f"the 110 symbols of {base} + 3 new from the training labels" in capsys.readouterr().err
    load_weights_into(model, base)
    src = load_model(base).state_dict()
    own = model.state_dict()
    for name in ("decoder.embed.weight", "decoder.out.weight", "decoder.out.bias"):
        assert own[name].shape[0] == src[name].shape[0] + 3
        assert torch.equal(own[name][: src[name].shape[0]], src[name])
    assert task.vocab.symbols == [*SYMBOLS, *NEW]
    assert task.checkpoint_meta({"data": {"root": "x"}})["data"]["symbols"] == [*SYMBOLS, *NEW]
    # data.vocab=fixed: no growth; the training expressions with new symbols are left out, and said so
    fixed = _task(_recipe(tmp_path / "data", base, "data.vocab=fixed"))
    assert fixed.build_model().decoder.embed.weight.shape[0] == 113
    assert len(fixed.build_dataset("train")) == 4
    assert "left out 12 expression(s) with symbols outside the vocabulary" in capsys.readouterr().err


def test_the_packaged_default_keeps_crohmes_vocabulary_and_grows_from_it(tmp_path, capsys):
    from tellkit.checkpoint import load_model, load_weights_into, read_checkpoint_config
    from tellkit.cli import main
    from tellkit.registry import create_model

    meta = read_checkpoint_config(DEFAULT)  # its family and config in the present checkpoint format
    assert "symbols" not in (meta.get("data") or {})  # nothing stored: the default 110
    from tellkit.tasks.recognition import RecognitionProcessor

    assert RecognitionProcessor.from_checkpoint(meta, DEFAULT).vocab.itos == Vocab().itos
    assert main(["model-info", str(DEFAULT)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocabulary"]["size"] == 113 and info["vocabulary"]["symbols"] == list(SYMBOLS)
    # fine-tuning it on three new symbols: three rows more, the 113 old ones exactly its own
    grown = create_model({"model": {"name": meta["family"], **meta["config"], "vocab_size": 116}})
    load_weights_into(grown, DEFAULT)
    src = load_model(DEFAULT).state_dict()
    for name in ("decoder.embed.weight", "decoder.out.weight", "decoder.out.bias"):
        assert torch.equal(grown.state_dict()[name][:113], src[name].to(grown.state_dict()[name].dtype))
    # a stored vocabulary that does not match the model's rows is refused
    with pytest.raises(TellkitError, match="113 output rows but its vocabulary"):
        RecognitionProcessor.from_checkpoint({**meta, "data": {**meta["data"], "symbols": [*SYMBOLS, "\\aleph"]}},
                                             DEFAULT)


@pytest.mark.slow
def test_fine_tuning_on_three_new_symbols_learns_to_write_them(tmp_path, capsys):
    from tellkit.cli import main

    _shapes(tmp_path / "data")
    base = _base(tmp_path / "base")
    run = tmp_path / "run"
    code = main(["train", "configs/bttr/tiny.yaml", "--out", str(run), "--no-progress",
                 *_recipe(tmp_path / "data", base, "train.max_steps=150", "train.max_epochs=1000",
                          "train.optimizer=adamw", "train.lr=3e-3", "train.accumulate=1", "train.batch_size=8",
                          "train.eval_every_epochs=1000", "train.scheduler=constant", "train.log_every=1000")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "+ 3 new from the training labels (\\aleph \\hbar \\nabla): 3 rows added" in err
    best = run / "checkpoints" / "best"
    stored = json.loads((best / "config.json").read_text())
    assert stored["data"]["symbols"] == [*SYMBOLS, *NEW] and stored["config"]["vocab_size"] == 116
    assert main(["model-info", str(best)]) == 0
    assert json.loads(capsys.readouterr().out)["vocabulary"]["symbols"][-3:] == NEW
    assert main(["evaluate", str(run), "--split", "test", "data.limit.test=null", "--out", str(tmp_path / "ev"),
                 "--device", "cpu", "--no-progress"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "ev" / "predictions_test.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    for sym in NEW:  # each new symbol is written, right, for most of its four drawings
        assert sum(r["correct"] for r in rows if r["reference"] == sym) >= 3, rows
