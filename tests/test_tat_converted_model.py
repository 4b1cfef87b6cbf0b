"""A converted official Transform and Tell checkpoint is a complete model: its folder names the
task, the encoders as the reference ran them, the data and generation settings; `caption` and
`evaluate` run it once those encoders' weights are given as local files, and without them stop
with one line naming what is missing (RoBERTa-large first) and how to pass it."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tellkit
from test_tat_convert import TINY, reference_state

SAMPLE_PHOTO = "584f1ddf95d0e0392607597e_0.jpg"


def tellkit_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tellkit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_converted_folder_names_task_encoders_data_and_generation(tmp_path):
    m = tellkit.create_model("tat/tiny", **{**TINY, "article_dim": 1024, "article_layers": 25, "face_dim": 512},
                             contexts=["image", "article", "faces", "objects"])
    torch.save(reference_state(m), tmp_path / "best.th")
    res = tellkit_cli("convert", tmp_path / "best.th", "-o", "num_heads=4", "-o", "recipe=tat/goodnews",
                      "--out", tmp_path / "conv")
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert meta["task"] == "caption" and meta["converted_recipe"] == "tat/goodnews"
    enc = meta["encoders"]
    assert (enc["article"], enc["image"], enc["faces"], enc["objects"]) == \
        ("roberta-large", "resnet152", "facenet_vggface2", "yolov3_resnet152")
    assert "image_weights" not in enc and "face_weights" not in enc  # nothing of theirs was in best.th
    assert (meta["data"]["format"], meta["data"]["context"], meta["data"]["max_article_tokens"]) == \
        ("goodnews", "first_tokens", 512)
    assert (meta["eval"]["beam_size"], meta["eval"]["max_len"]) == (1, 101)
    bad = tellkit_cli("convert", tmp_path / "best.th", "-o", "num_heads=4", "-o", "recipe=tat/small",
                      "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "not a Transform and Tell paper recipe" in bad.stderr


def test_without_the_encoders_caption_names_each_missing_one_in_one_line(tmp_path):
    """No RoBERTa-large on this machine (hub offline), no VGGFace2 FaceNet, no ResNet-152 in the
    checkpoint: one line names all three, their sources and the flag, before the model loads."""
    m = tellkit.create_model("tat/tiny", **{**TINY, "article_dim": 1024, "article_layers": 25, "face_dim": 512},
                             contexts=["image", "article", "faces"])
    torch.save(reference_state(m), tmp_path / "best.th")
    assert tellkit_cli("convert", tmp_path / "best.th", "-o", "num_heads=4", "--out", tmp_path / "conv").returncode == 0
    photo = tmp_path / "photo.png"
    from PIL import Image

    Image.new("RGB", (64, 48), (120, 80, 40)).save(photo)
    res = tellkit_cli("caption", photo, "--model", tmp_path / "conv")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip()
    assert "\n" not in line
    for needed in ("RoBERTa-large", "--encoder article=DIR", "encoders.article=DIR",
                   "FaceNet (VGGFace2)", "20180402-114759-vggface2.pt", "--encoder face_weights=FILE",
                   "ResNet-152", "resnet152-394f9c45.pth", "--encoder image_weights=FILE"):
        assert needed in line, needed
    bad = tellkit_cli("caption", photo, "--model", tmp_path / "conv", "--encoder", "article")
    assert bad.returncode == 2 and "--encoder expects KEY=VALUE" in bad.stderr


@pytest.fixture(scope="module")
def paper_checkpoint(tmp_path_factory):
    """A paper-size best.th in the reference layout (random values, its ResNet-152 inside, as the
    official file), a random RoBERTa of RoBERTa-large's layout (24 layers, 1024-d: 25 x 1024 hidden
    states; a 16-wide feed-forward keeps it small) with RoBERTa's tokenizer files, and a random
    FaceNet in facenet-pytorch's layout: the files a user brings, at the shapes the model needs."""
    from transformers import RobertaConfig, RobertaModel

    from tellkit.encoders.faces.facenet import InceptionResnetV1
    from tellkit.encoders.resnet import BLOCKS, ResNet
    from tellkit.encoders.tokenizer import CaptionTokenizer

    d = tmp_path_factory.mktemp("paper")
    torch.manual_seed(0)
    m = tellkit.create_model("tat/nytimes_faces")
    resnet = {f"resnet.{k}": v for k, v in ResNet(BLOCKS["resnet152"]).state_dict().items()}
    torch.save({**reference_state(m), **resnet}, d / "best.th")
    del m, resnet
    torch.save(InceptionResnetV1().state_dict(), d / "vggface2.pt")
    CaptionTokenizer.load().save_pretrained(d / "roberta")
    cfg = RobertaConfig(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=16, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2)
    RobertaModel(cfg).save_pretrained(d / "roberta")
    return d


@pytest.mark.slow
def test_paper_size_checkpoint_converts_and_runs_caption_and_evaluate(paper_checkpoint, tmp_path, shared_data):
    d = paper_checkpoint
    res = tellkit_cli("convert", d / "best.th", "-o", "recipe=tat/goodnews", "--out", tmp_path / "conv")
    assert res.returncode == 0, res.stderr
    conv = tmp_path / "conv"
    meta = json.loads((conv / "config.json").read_text())
    assert meta["encoders"]["image_weights"] == "image_encoder.safetensors"  # best.th's own ResNet-152
    sample = shared_data / "goodnews_sample"
    photo = sample / "images" / SAMPLE_PHOTO
    story = tmp_path / "story.txt"
    story.write_text("Mayor Ana Ruiz spoke on Tuesday.\n\nThe rail yard will become a park.\n", encoding="utf-8")

    res = tellkit_cli("caption", photo, "--article", story, "--model", conv)
    assert res.returncode == 2 and "RoBERTa-large" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    encoders = ["--encoder", f"article={d / 'roberta'}", "--encoder", f"face_weights={d / 'vggface2.pt'}"]
    res = tellkit_cli("caption", photo, "--article", story, "--model", conv, "--max-len", "6", "--json", *encoders)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["text"] and out["model"]["article_encoder"] == str(d / "roberta")
    assert len(out["article_tokens"]) > 10  # RoBERTa's BPE pieces of the story

    data = tmp_path / "goodnews"
    shutil.copytree(sample, data)
    photos = sorted(p.name for p in (data / "images").iterdir())
    splits = {name: ("test" if name == SAMPLE_PHOTO else "train") for name in photos}
    (data / "img_splits.json").write_text(json.dumps(splits))
    res = tellkit_cli("evaluate", conv, f"encoders.article={d / 'roberta'}",
                      f"encoders.face_weights={d / 'vggface2.pt'}", "eval.max_len=6", "--data", data,
                      "--split", "test", "--out", tmp_path / "eval", "--no-progress")
    assert res.returncode == 0, res.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics_test.json").read_text())
    assert metrics["n"] == 1 and "bleu4" in metrics["metrics"] and metrics["task"] == "caption"
    preds = (tmp_path / "eval" / "predictions_test.jsonl").read_text().splitlines()
    assert len(preds) == 1

    res = tellkit_cli("evaluate", conv, "--data", data, "--split", "test", "--out", tmp_path / "eval2")
    assert res.returncode == 2 and "RoBERTa-large" in res.stderr and len(res.stderr.strip().splitlines()) == 1



def test_serve_passes_its_encoder_flags_to_the_captioner(tmp_path):
    """`tellkit serve --model caption=DIR --encoder article=...`: the local copy reaches the
    captioner's encoders (a folder that does not exist is named); without it, RoBERTa-large is."""
    import argparse

    from tellkit.cli import cmd_serve

    m = tellkit.create_model("tat/tiny", **{**TINY, "article_dim": 1024, "article_layers": 25, "face_dim": 512},
                             contexts=["image", "article"])
    torch.save(reference_state(m), tmp_path / "best.th")
    assert tellkit_cli("convert", tmp_path / "best.th", "-o", "num_heads=4", "--out", tmp_path / "conv").returncode == 0

    def args(*argv):
        p = argparse.ArgumentParser()
        cmd_serve.add_arguments(p)
        return p.parse_args(["--models", "caption", "--model", f"caption={tmp_path / 'conv'}", *argv])

    with pytest.raises(tellkit.TellkitError, match="RoBERTa-large cannot be loaded") as info:
        cmd_serve.load_backends(args("--encoder", "image_weights=random"))
    assert "\n" not in str(info.value) and "ResNet-152" not in str(info.value)  # image_weights reached it
    missing = tmp_path / "no-roberta-here"
    with pytest.raises(tellkit.TellkitError, match=str(missing)):
        cmd_serve.load_backends(args("--encoder", "image_weights=random", "--encoder", f"article={missing}"))


def test_evaluate_names_the_missing_encoder_before_loading_the_model(tmp_path):
    m = tellkit.create_model("tat/tiny", **{**TINY, "article_dim": 1024, "article_layers": 25, "face_dim": 512},
                             contexts=["image", "article"])
    torch.save(reference_state(m), tmp_path / "best.th")
    res = tellkit_cli("convert", tmp_path / "best.th", "-o", "num_heads=4", "-o", "recipe=tat/goodnews",
                      "--out", tmp_path / "conv")
    assert res.returncode == 0, res.stderr
    (tmp_path / "conv" / "model.safetensors").write_bytes(b"not read")  # the check comes before the model
    fixture = __import__("pathlib").Path(__file__).parent / "fixtures" / "goodnews"
    res = tellkit_cli("evaluate", tmp_path / "conv", "encoders.image_weights=random", "--data", fixture,
                      "--split", "test", "--out", tmp_path / "ev", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "RoBERTa-large cannot be loaded" in res.stderr and "encoders.article=DIR" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
