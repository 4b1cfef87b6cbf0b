"""Transform and Tell's encoders as the reference ran them (``encoders.mode: reference``): the
reference trains with ``model.train()`` and only turns gradients off for ResNet-152 and RoBERTa,
so BatchNorm normalises with the batch's statistics and updates its running statistics, and
RoBERTa applies dropout; features are computed in each step. tellkit's frozen mode (eval-mode
encoders, cacheable features) stays the CPU recipes' choice."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tellkit.config import deep_merge, load_yaml
from tellkit.encoders.bundle import EncoderBundle, EncodersConfig
from tellkit.encoders.image import ImageEncoder
from tellkit.errors import TellkitError
from tellkit.recipes import section

torch.set_num_threads(1)


class TinyBackbone(nn.Module):
    out_dim = 4

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 8, stride=8)
        self.bn = nn.BatchNorm2d(4)

    def forward_features(self, x):
        return self.bn(self.conv(x))


def test_image_encoder_bn_as_the_reference_in_train_mode():
    torch.manual_seed(0)
    enc = ImageEncoder("tiny", TinyBackbone())
    x = torch.randn(3, 3, 32, 32)
    enc.train()  # frozen (default): BatchNorm stays in eval, running stats untouched
    assert not enc.backbone.bn.training
    frozen, _ = enc(x)
    assert torch.equal(enc.backbone.bn.running_mean, torch.zeros(4))
    enc.follows_train_mode = True
    enc.train()
    assert enc.backbone.bn.training and not any(p.requires_grad for p in enc.parameters())
    with torch.no_grad():
        feats, _ = enc(x)
    # the reference's step, re-stated: batch statistics normalise; running stats move by momentum 0.1
    c = enc.backbone.conv(x).detach()
    mean, var = c.mean((0, 2, 3)), c.var((0, 2, 3), unbiased=False)
    want = (c - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + 1e-5)
    torch.testing.assert_close(feats, want.flatten(2).transpose(1, 2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.backbone.bn.running_mean, 0.1 * mean)
    torch.testing.assert_close(enc.backbone.bn.running_var, 0.9 + 0.1 * c.var((0, 2, 3), unbiased=True))
    enc.eval()  # evaluation (model.eval()): the updated running statistics
    with torch.no_grad():
        ev, _ = enc(x)
    rm, rv = enc.backbone.bn.running_mean, enc.backbone.bn.running_var
    torch.testing.assert_close(ev, F.batch_norm(c, rm, rv).flatten(2).transpose(1, 2))
    assert not torch.allclose(ev, frozen)


def test_article_encoder_dropout_only_in_reference_train_mode():
    from tellkit.encoders.text import ArticleEncoder

    torch.manual_seed(0)
    enc = ArticleEncoder()  # the packaged MiniLM (dropout 0.1)
    text = ["The mayor opened the new bridge in Albany on Monday."]
    enc.train()
    a, b = enc.encode(text)["hidden"], enc.encode(text)["hidden"]
    assert not enc.model.training and torch.equal(a, b)  # frozen: no dropout
    enc.follows_train_mode = True
    enc.train()
    c, d = enc.encode(text)["hidden"], enc.encode(text)["hidden"]
    assert enc.model.training and not torch.equal(c, d) and not c.requires_grad
    enc.eval()
    torch.testing.assert_close(enc.encode(text)["hidden"], a)


@pytest.mark.parametrize("name,mode", [("tat/nytimes_faces", "reference"), ("tat/nytimes_full", "reference"),
                                       ("tat/goodnews", "reference"), ("tat/small", "frozen"), ("tat/tiny", "frozen"),
                                       ("tat/flickr8k_small", "frozen"),
                                       ("baselines/nytimes/transformer_roberta", "reference"),  # Table 4 rows
                                       ("baselines/nytimes/face_attention", "reference"),
                                       ("baselines/flickr8k/transformer_weighted", "frozen")])
def test_paper_recipes_run_the_encoders_in_the_reference_mode(name, mode):
    enc = section(load_yaml(name), "encoders", EncodersConfig)
    assert enc.mode == mode
    assert enc.dataset_images == ("reference" if mode == "reference" else "tellkit")


def test_reference_mode_refuses_a_feature_cache_and_bad_values(tmp_path):
    from tellkit.tasks.captioning import CaptioningTask

    r = deep_merge(load_yaml("tat/tiny"), {"encoders": {"mode": "reference"},
                                           "data": {"format": "goodnews", "features": str(tmp_path)}})
    with pytest.raises(TellkitError, match="data.features cannot be used with encoders.mode: reference") as e:
        CaptioningTask(r)
    assert "\n" not in str(e.value)
    with pytest.raises(TellkitError, match="encoders.mode must be one of frozen, reference"):
        EncodersConfig(mode="train")


class _Recorder:
    """A fake image encoder that records the mode it ran in (and follows train() like the real one)."""

    out_dim, name, follows_train_mode, training = 16, "fake", False, False

    def __init__(self):
        self.seen = []

    def train(self, mode=True):
        self.training = mode and self.follows_train_mode

    def encode(self, pils, resample=None):
        self.seen.append((len(pils), self.training))
        x = torch.randn(len(pils), 5, 16)
        return x, torch.ones(x.shape[:2], dtype=torch.bool)


def test_reference_mode_encodes_each_batch_in_the_step_in_the_model_mode(tmp_path):
    from pathlib import Path

    from tellkit.tasks.captioning import CaptioningTask

    fix = Path(__file__).parent / "fixtures" / "goodnews"
    r = deep_merge(load_yaml("tat/tiny"), {"model": {"contexts": ["image"]}, "encoders": {"mode": "reference"},
                                           "data": {"format": "goodnews", "root": str(fix), "context": "none"}})
    img = _Recorder()

    class Bundle(EncoderBundle):
        image_encoder = property(lambda self: self._follow(img))

    task = CaptioningTask(r, bundle=Bundle({"mode": "reference"}, ("image",), context_mode="none"))
    ds = task.build_dataset("train")
    item = ds[0]
    assert "image" not in item and item["input"].from_dataset  # nothing encoded in the dataset
    batch = task.collate([ds[i] for i in range(len(ds))])
    model = nn.Linear(1, 1)
    out = task.on_device(batch, model.train())
    assert out["image"].shape[:2] == (len(ds), 5) and out["caption"].shape[0] == len(ds)
    assert img.seen == [(len(ds), True)]  # the whole batch at once, in train mode
    task.on_device(task.collate([ds[0]]), model.eval())
    assert img.seen[-1] == (1, False)
