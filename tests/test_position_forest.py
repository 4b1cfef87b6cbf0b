"""PosFormer's position-forest targets against a re-statement of the reference's computation
(SJTU-DeepVisionLab/PosFormer, label_make_muti.py: a label list per token, built level by level,
then layer = len - 1 capped at 4 and position = the second-to-last label)."""
from __future__ import annotations

import pytest
import torch

from tellkit.data.position_forest import LOWER, MAIN, UPPER, position_forest


def _reference(tokens: list[str]) -> tuple[list[int], list[int]]:
    """The reference's rule, re-stated on token strings: every token of a level gets 3, tokens
    inside a group first get the group's label (4 upper: ^, numerator, root index; 5 lower: _,
    denominator, radicand), then their own level's labels."""
    labels: list[list[int]] = [[] for _ in tokens]

    def close(i, end, a, b):
        n, j = 1, i + 1
        while n > 0 and j < end:
            n += (tokens[j] == a) - (tokens[j] == b)
            j += 1
        return j - 1 if n == 0 else 0

    def level(start, end):
        i = start + 1
        while i < end:
            t = tokens[i]
            if t in ("^", "_"):
                e = close(i + 1, end, "{", "}")
                for k in (i, i + 1, e):
                    labels[k].append(3)
                for k in range(i + 2, e):
                    labels[k].append(4 if t == "^" else 5)
                level(i + 1, e)
                i = e + 1
            elif t == "\\frac" or (t == "\\sqrt" and tokens[i + 1] == "["):
                a, b = ("[", "]") if t == "\\sqrt" else ("{", "}")
                e1 = close(i + 1, end, a, b)
                e2 = close(e1 + 1, end, "{", "}")
                for k in (i, i + 1, e1, e1 + 1, e2):
                    labels[k].append(3)
                for k in range(i + 2, e1):
                    labels[k].append(4)
                for k in range(e1 + 2, e2):
                    labels[k].append(5)
                level(i + 1, e1)
                level(e1 + 1, e2)
                i = e2 + 1
            elif t == "\\sqrt":
                e = close(i + 1, end, "{", "}")
                for k in (i, i + 1, e):
                    labels[k].append(3)
                for k in range(i + 2, e):
                    labels[k].append(5)
                level(i + 1, e)
                i = e + 1
            else:
                labels[i].append(3)
                i += 1

    level(-1, len(tokens))
    layers, positions = [], []
    for lab in labels:
        if len(lab) == 1:
            layers.append(0)
            positions.append(lab[0] - 3)
        elif len(lab) <= 5:
            layers.append(len(lab) - 1)
            positions.append(lab[-2] - 3)
        else:
            layers.append(4)
            positions.append(lab[3] - 3)
    return layers, positions


CASES = [
    "x",
    "x ^ { 2 } + 1",
    "\\frac { a + b } { c _ { i } }",
    "\\sqrt { x ^ { 2 } + y ^ { 2 } }",
    "\\sqrt [ 3 ] { \\frac { 1 } { 2 } }",
    "e ^ { x ^ { y ^ { z ^ { w ^ { v } } } } }",  # deeper than the cap of 4
    "\\sum _ { i = 1 } ^ { n } a _ { i } { b }",  # a brace that opens no argument
    "\\frac { \\frac { 1 } { x } } { \\sqrt [ n ] { a _ { 1 } ^ { 2 } } } - \\{ x \\}",
]


@pytest.mark.parametrize("text", CASES)
def test_targets_equal_the_reference_rule(text):
    tokens = text.split()
    assert position_forest(tokens) == _reference(tokens)


def test_targets_by_hand():
    layers, pos = position_forest("x ^ { 2 } + \\frac { a } { b }".split())
    assert layers == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0]
    assert pos == [MAIN, MAIN, MAIN, UPPER, MAIN, MAIN, MAIN, MAIN, UPPER, MAIN, MAIN, LOWER, MAIN]
    # six deep: layer capped at 4, position of the fourth group from the outside
    layers, pos = position_forest("a ^ { b _ { c ^ { d _ { e ^ { f _ { g } } } } } }".split())
    assert layers[-7] == 4 and pos[-7] == LOWER  # g: groups ^ _ ^ _ ^ _, the fourth is _
    # unclosed or missing arguments open nothing
    assert position_forest("x ^ { 2".split()) == ([0, 0, 0, 0], [MAIN] * 4)
    assert position_forest("\\frac { 1 }".split()) == ([0, 0, 0, 0], [MAIN] * 4)
    assert position_forest([]) == ([], [])


@pytest.mark.data
def test_crohme_expressions_equal_the_reference_rule(shared_data):
    from tellkit.data.crohme import load_split

    exprs = load_split(shared_data / "crohme_inkml", "2014", "inkml")  # all 986 of 2014 test
    deep = 0
    for e in exprs:
        got = position_forest(e.tokens)
        assert got == _reference(list(e.tokens)), " ".join(e.tokens)
        deep += max(got[0], default=0) >= 2
    assert deep > 10


# --- the recipe switch: BTTR's training with the position-forest heads ---------------------------
def _tiny(position_forest=0.0):
    from tellkit.models.bttr import BTTR, BTTRConfig

    torch.manual_seed(0)
    return BTTR(BTTRConfig(growth_rate=4, block_depth=2, stem_channels=8, d_model=32, nhead=4, num_decoder_layers=2,
                           dim_feedforward=64, dropout=0.0, encoder_dropout=0.0, max_len=12, beam_size=2,
                           position_forest=position_forest))


def _batch():
    from tellkit.data.crohme import collate
    from tellkit.data.latex import Vocab

    v = Vocab()
    texts = ["x ^ { 2 } + 1", "\\frac { a } { b _ { i } }"]
    g = torch.Generator().manual_seed(0)
    items = [{"image": torch.rand(1, 32, 48, generator=g), "labels": [v.stoi[t] for t in s.split()], "id": str(i),
              "tokens": s.split()} for i, s in enumerate(texts)]
    return collate(items), texts


def test_forest_targets_follow_both_directions():
    from tellkit.data.position_forest import IGNORE
    from tellkit.models.bttr import bidirectional_targets, forest_targets

    batch, texts = _batch()
    inp, tgt = bidirectional_targets(batch["labels"], batch["label_lengths"])
    layer_t, pos_t = forest_targets(batch["labels"], batch["label_lengths"], tgt.shape[1])
    assert layer_t.shape == pos_t.shape == tgt.shape
    for i, text in enumerate(texts):
        layers, positions = position_forest(text.split())
        n = len(layers)
        assert layer_t[i, :n].tolist() == layers and pos_t[i, :n].tolist() == positions
        assert layer_t[2 + i, :n].tolist() == layers[::-1] and pos_t[2 + i, :n].tolist() == positions[::-1]
        assert (layer_t[i, n:] == IGNORE).all() and (pos_t[2 + i, n:] == IGNORE).all()  # end token, padding


def test_forest_loss_mixes_as_posformer_and_search_is_untouched(tmp_path):
    import torch.nn.functional as F

    from tellkit.checkpoint import load_weights_into
    from tellkit.models.bttr import bidirectional_targets, forest_targets

    plain, withf = _tiny(), _tiny(0.25)
    extra = 2 * (32 * 128 + 128) + (128 * 5 + 5) + (128 * 3 + 3)
    assert withf.num_parameters() == plain.num_parameters() + extra
    plain.save_pretrained(tmp_path / "plain")
    load_weights_into(withf, tmp_path / "plain")  # the heads are new, everything else copied
    assert withf.init_report["new"] == sorted(k for k in withf.state_dict() if k.startswith("decoder.forest."))
    batch, _ = _batch()
    plain.train(), withf.train()
    a, b = plain(batch), withf(batch)
    inp, tgt = bidirectional_targets(batch["labels"], batch["label_lengths"])
    layer_t, pos_t = forest_targets(batch["labels"], batch["label_lengths"], tgt.shape[1])
    hidden = withf.decoder.last_hidden
    ce_l = F.cross_entropy(withf.decoder.forest["layer"](hidden).reshape(-1, 5), layer_t.reshape(-1), ignore_index=-100)
    ce_p = F.cross_entropy(withf.decoder.forest["position"](hidden).reshape(-1, 3), pos_t.reshape(-1),
                           ignore_index=-100)
    assert torch.allclose(b["loss"], (a["loss"] + 0.25 * ce_l + 0.25 * ce_p) / 1.5, atol=1e-5)
    b["loss"].backward()
    assert withf.decoder.forest["layer"][0].weight.grad.abs().sum() > 0
    plain.eval(), withf.eval()
    with torch.no_grad():
        assert torch.allclose(plain(batch)["loss"], withf(batch)["loss"], atol=1e-6)  # validation loss: ce alone
    assert plain.generate(batch["image"], batch["image_mask"]) == withf.generate(batch["image"], batch["image_mask"])


def test_forest_recipe_switch_builds_and_trains_a_step(tmp_path, capsys):
    from tellkit.cli import main
    from tellkit.config import load_yaml
    from test_bttr_cli import _dataset

    r = load_yaml("configs/bttr/crohme_aug_extra_forest.yaml")
    assert r["model"]["position_forest"] == 0.25 and r["data"]["val"] == "../crohme_extra/train"
    _dataset(tmp_path / "data")
    over = [f"data.root={tmp_path / 'data'}", "data.layout=tsv", "data.train=train", "data.val=train",
            "data.test=train", "data.limit={}", "data.scale=0.5", "train.max_steps=1", "eval.beam_size=2",
            "eval.max_len=6", "model.position_forest=0.25"]
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(tmp_path / "run"), "--device", "cpu",
                 "--no-progress"]) == 0
    import json

    meta = json.loads((tmp_path / "run" / "checkpoints" / "best" / "config.json").read_text())
    assert meta["config"]["position_forest"] == 0.25
