"""BTTR in tellkit 0.1's own layout (family ``bttr_legacy``): its checkpoints load and give the
outputs they gave.

``tests/fixtures/bttr_tellkit_0_1`` is a tiny BTTR of that layout as tellkit 0.1 wrote it
(config.json of format 1, family ``bttr``, no ``variant``, ``tellkit_version`` 0.1.0; BatchNorm
statistics and affine terms away from the identity), with the outputs :func:`record` gave for it
when the layout was still a variant of ``tellkit.models.bttr``: memory (padded batch and one
image), validation logits, a training step's loss, logits and gradients (dropout seeded), and the
joint search's tokens and scores. Loading it must reproduce every one bit for bit."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tellkit.checkpoint import FORMAT_VERSION, load_model, read_checkpoint_config
from tellkit.cli import main
from tellkit.errors import TellkitError
from tellkit.layers.positional import SinusoidalPositions
from tellkit.models.bttr import BTTR, image_positions, word_positions
from tellkit.models.bttr_legacy import BTTRLegacy, legacy_image_positions
from tellkit.registry import build_config, create_model

FIXTURE = Path(__file__).parent / "fixtures" / "bttr_tellkit_0_1"


def record(m) -> tuple[dict[str, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(1)
    img = torch.rand(2, 1, 48, 80, generator=g)
    mask = torch.zeros(2, 48, 80, dtype=torch.bool)
    mask[0] = True
    mask[1, :32, :64] = True
    img = img * mask[:, None]
    batch = {"image": img, "image_mask": mask, "labels": torch.tensor([[5, 9, 12, 7], [20, 3, 0, 0]]),
             "label_lengths": torch.tensor([4, 2])}
    res = {}
    m.eval()
    with torch.no_grad():
        res["memory"], res["memory_mask"] = m.encode(img, mask)
        res["memory_one"] = m.encode(img[:1], None)[0]
        res["eval_logits"] = m(batch)["logits"]
        gen = m.generate(img, mask, beam_size=3, max_len=8)
    m.train()
    torch.manual_seed(3)
    out = m(batch)
    out["loss"].backward()
    res["train_loss"] = out["loss"].detach().reshape(1)
    res["train_logits"] = out["logits"].detach()
    res["grad_stem"] = m.encoder.densenet.stem.weight.grad.clone()
    res["grad_embed"] = m.decoder.embed.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    m.eval()
    return res, {"tokens": gen["tokens"], "scores": gen["scores"]}


def assert_recorded_outputs(m) -> None:
    got, search = record(m)
    want = load_file(str(FIXTURE / "outputs.safetensors"))
    assert got.keys() == want.keys()
    differ = [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert not differ, differ
    assert search == json.loads((FIXTURE / "search.json").read_text())
    assert all(len(t) == 8 for t in search["tokens"])  # the search writes symbols: a real check


def copy_fixture(tmp_path, **changes) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    meta = json.loads((d / "config.json").read_text())
    meta.update({k: v for k, v in changes.items() if k != "config"})
    meta["config"].update(changes.get("config", {}))
    (d / "config.json").write_text(json.dumps(meta))
    return d


def test_a_tellkit_0_1_checkpoint_gives_its_recorded_outputs():
    meta = json.loads((FIXTURE / "config.json").read_text())
    assert meta["family"] == "bttr" and "variant" not in meta["config"] and meta["format_version"] == 1
    m = load_model(FIXTURE)
    assert type(m) is BTTRLegacy and m.family == "bttr_legacy"
    assert_recorded_outputs(m)


def test_a_checkpoint_naming_the_tellkit_0_1_variant_gives_the_recorded_outputs(tmp_path):
    d = copy_fixture(tmp_path, config={"variant": "tellkit-0.1"})
    assert read_checkpoint_config(d)["family"] == "bttr_legacy"
    assert_recorded_outputs(BTTR.from_pretrained(d))  # a bttr_legacy model is a BTTR


def test_saved_again_it_is_a_bttr_legacy_checkpoint_with_the_same_outputs(tmp_path):
    out = load_model(FIXTURE).save_pretrained(tmp_path / "again")
    meta = json.loads((out / "config.json").read_text())
    assert meta["family"] == "bttr_legacy" and meta["format_version"] == FORMAT_VERSION
    assert "variant" not in meta["config"]
    assert_recorded_outputs(load_model(out))


def test_present_checkpoints_keep_their_layout(tmp_path):
    # a BTTR written now has no variant and tellkit_version 0.1.x too: it is the reference's layout
    out = create_model("bttr/tiny").save_pretrained(tmp_path / "new")
    meta = json.loads((out / "config.json").read_text())
    assert meta["tellkit_version"].startswith("0.1") and "variant" not in meta["config"]
    assert type(load_model(out)) is BTTR
    # format 1 with the reference variant (every BTTR saved since variants existed)
    meta.update(format_version=1, config={**meta["config"], "variant": "reference"})
    (out / "config.json").write_text(json.dumps(meta))
    assert read_checkpoint_config(out)["family"] == "bttr" and "variant" not in read_checkpoint_config(out)["config"]
    assert type(load_model(out)) is BTTR
    # and the weights of the other layout do not pass for it
    d = copy_fixture(tmp_path, config={"variant": "reference"})
    with pytest.raises(TellkitError, match="has shape"):
        load_model(d)


def test_an_unknown_variant_is_one_clear_error(tmp_path):
    d = copy_fixture(tmp_path, config={"variant": "tellkit-9"})
    with pytest.raises(TellkitError, match="unknown bttr variant 'tellkit-9'") as e:
        load_model(d)
    assert "\n" not in str(e.value)


def test_a_config_builds_the_family_registered_with_its_class():
    from tellkit.models.bttr_legacy import BTTRLegacyConfig
    from tellkit.models.comer import CoMER, ComerConfig

    tiny = {"d_model": 32, "nhead": 4, "growth_rate": 4, "block_depth": 2, "stem_channels": 8}
    assert type(create_model(BTTRLegacyConfig(**tiny))) is BTTRLegacy
    assert type(create_model(ComerConfig(**tiny))) is CoMER
    assert type(create_model(build_config("bttr/tiny")[1])) is BTTR


def test_cpu_recipe_trains_the_legacy_family_at_its_size():
    entry, cfg = build_config("configs/bttr/cpu.yaml")
    assert entry.name == "bttr_legacy"
    with torch.device("meta"):
        m = entry.model_cls(cfg)
    assert m.num_parameters(trainable_only=True) == 6_409_481


def test_no_export_of_the_legacy_layout(tmp_path, capsys):
    d = copy_fixture(tmp_path)
    assert main(["export", str(d), "--format", "reference", "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "bttr_legacy" in err and "\n" not in err
    assert not (tmp_path / "x.ckpt").exists()
    assert main(["export", str(d), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tellkit 0.1" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def _far_from_all(legacy: torch.Tensor, reference: torch.Tensor) -> int:
    """How many channels (columns) of ``legacy`` differ by more than 0.1, at some position, from
    every channel of ``reference`` (far above float rounding)."""
    gap = torch.cdist(legacy.T.double(), reference.T.double(), p=float("inf")).min(1).values
    return int((gap > 0.1).sum())


def test_the_positions_are_not_a_reordering_of_the_references():
    """Why the layout is kept as it is, not converted: the positions are added, not learned, so a
    reordering of channels could be carried into the weights, but these are other functions."""
    d = 256
    mask = torch.ones(1, 7, 23, dtype=torch.bool)
    img = _far_from_all(legacy_image_positions(mask, d).reshape(-1, d), image_positions(mask, d).reshape(-1, d))
    words = _far_from_all(SinusoidalPositions(d)(100, 0), word_positions(100, d))
    assert (img, words) == (22, 78)
