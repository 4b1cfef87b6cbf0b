"""`tellkit convert` for the official Transform and Tell checkpoint (AllenNLP best.th): a state
dict in the reference's key layout converts, loads, and gives the same forward pass."""
import subprocess
import sys

import pytest
import torch

import tellkit

TINY = dict(vocab_size=99, adaptive_cutoffs=[20, 50], article_dim=32, **dict(
    dropout=0.0, attention_dropout=0.0, input_dropout=0.0, weight_dropout=0.0))
REF_CTX = {"image": "image", "article": "article", "faces": "faces", "objects": "obj"}


def reference_state(m) -> dict:
    """The tellkit model's weights under the reference's names and shapes (AllenNLP model with a
    fairseq-style decoder), plus what best.th also holds: frozen encoders, buffers, tied copies."""
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    ref = {}
    emb = "decoder.embedder.token_embedder_adaptive.embeddings"
    for b in range(len(m.embed.embeddings)):
        ref[f"{emb}.{b}.0.weight"] = sd[f"embed.embeddings.{b}.weight"]
        ref[f"{emb}.{b}.1.weight"] = sd[f"embed.projections.{b}.weight"]
    ref["decoder.embedder.token_embedder_adaptive._float_tensor"] = torch.zeros(1)
    ref["decoder.embedder.token_embedder_position.weights"] = torch.randn(513, m.config.d_model)
    ref["decoder.adaptive_softmax.head.word_proj.weight"] = sd["embed.embeddings.0.weight"]
    ref["decoder.adaptive_softmax.head.class_proj.weight"] = sd["softmax.class_proj.weight"]
    ref["decoder.adaptive_softmax.head._float_tensor"] = torch.zeros(1)
    for t in range(len(m.embed.embeddings) - 1):
        ref[f"decoder.adaptive_softmax.tail.{t}.0.weight"] = sd[f"softmax.tail_proj.{t}.weight"]
        ref[f"decoder.adaptive_softmax.tail.{t}.2.weight"] = sd[f"embed.embeddings.{t + 1}.weight"]
    ref["decoder.adaptive_softmax.version"] = torch.tensor([1])
    d = m.config.d_model
    for i in range(m.config.num_layers):
        src, dst = f"layers.{i}", f"decoder.layers.{i}"
        for a, b in (("conv.linear1", "linear1"), ("conv.linear2", "linear2"), ("context_proj", "context_fc"),
                     ("fc1", "fc1"), ("fc2", "fc2")):
            for n in ("weight_g", "weight_v", "bias"):
                ref[f"{dst}.{b}.{n}"] = sd[f"{src}.{a}.{n}"]
        ref[f"{dst}.conv.weight_linear.weight"] = sd[f"{src}.conv.conv.weight_linear.weight"]
        for a, b in (("conv_norm", "conv_layer_norm"), ("final_norm", "final_layer_norm")):
            for n in ("weight", "bias"):
                ref[f"{dst}.{b}.{n}"] = sd[f"{src}.{a}.{n}"]
        for name in m.config.contexts:
            t, r = f"{src}.context_attn.{name}", f"{dst}.context_attns.{REF_CTX[name]}"
            q, k, v = (sd[f"{t}.{p}_proj.weight"] for p in "qkv")
            if k.shape[1] == d:  # the reference stacks q, k, v when the keys are d-wide
                ref[f"{r}.in_proj_weight"] = torch.cat([q, k, v])
            else:
                ref[f"{r}.q_proj_weight"], ref[f"{r}.k_proj_weight"], ref[f"{r}.v_proj_weight"] = q, k, v
            ref[f"{r}.in_proj_bias"] = torch.cat([sd[f"{t}.{p}_proj.bias"] for p in "qkv"])
            for n in ("weight", "bias"):
                ref[f"{r}.out_proj.{n}"] = sd[f"{t}.out_proj.{n}"]
            ref[f"{r}.bias_k"], ref[f"{r}.bias_v"] = sd[f"{t}.bias_k"], sd[f"{t}.bias_v"]
            for n in ("weight", "bias"):
                ref[f"{dst}.context_attn_lns.{REF_CTX[name]}.{n}"] = sd[f"{src}.context_norm.{name}.{n}"]
    ref["bert_weight"] = sd["article_mix.weights"]
    ref["roberta.model.decoder.sentence_encoder.embed_tokens.weight"] = torch.randn(5, 4)  # frozen, left out
    return ref


def random_weights(m):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def batch(contexts, B=2, T=7):
    g = torch.Generator().manual_seed(0)
    cap = torch.randint(3, 99, (B, T), generator=g)
    cap[:, 0], cap[:, -1], cap[1, -2:] = 0, 2, 1  # second caption padded
    feats = {"image": torch.randn(B, 5, 16, generator=g), "article": torch.randn(B, 3, 6, 32, generator=g),
             "faces": torch.randn(B, 2, 8, generator=g), "objects": torch.randn(B, 3, 12, generator=g)}
    out = {"caption": cap, **{k: v for k, v in feats.items() if k in contexts}}
    if "faces" in contexts:
        out["faces_mask"] = torch.tensor([[True, True], [False, False]])  # an image without faces
    return out


@pytest.mark.parametrize("contexts", [["image", "article", "faces"], ["image", "article", "faces", "objects"]])
def test_reference_checkpoint_converts_and_gives_the_same_forward(tmp_path, contexts):
    m = tellkit.create_model("tat/tiny", **TINY, contexts=contexts).eval()
    random_weights(m)
    torch.save(reference_state(m), tmp_path / "best.th")
    res = subprocess.run([sys.executable, "-m", "tellkit", "convert", str(tmp_path / "best.th"),
                          "-o", "num_heads=4", "--out", str(tmp_path / "conv")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    conv = tellkit.load_model(tmp_path / "conv").eval()
    c = conv.config
    assert (list(c.contexts), c.d_model, list(c.kernel_sizes), c.position_start, c.gehring_linear) == \
        (contexts, 32, [3, 5], 2, True)
    assert (c.image_dim, c.article_dim, c.face_dim, c.article_layers) == (16, 32, 8, 3)
    b = batch(contexts)
    torch.testing.assert_close(conv.log_probs(b), m.log_probs(b), rtol=0, atol=1e-5)
    assert conv.generate(b, max_len=6)["tokens"] == m.generate(b, max_len=6)["tokens"]


def test_converter_refuses_foreign_or_damaged_layouts(tmp_path):
    from tellkit.convert import transform_and_tell as conv

    m = tellkit.create_model("tat/tiny", **TINY, contexts=["image", "article", "faces"])
    ref = reference_state(m)
    assert conv.matches(ref) and not conv.matches({"decoder.layers.0.weight": torch.zeros(1)})
    bad = dict(ref)
    bad["decoder.layers.0.mystery.weight"] = torch.zeros(3)
    with pytest.raises(tellkit.TellkitError, match="no place"):
        conv.convert(bad, num_heads=4)
    bad = dict(ref)
    bad["decoder.adaptive_softmax.tail.0.2.weight"] = torch.zeros_like(bad["decoder.adaptive_softmax.tail.0.2.weight"])
    with pytest.raises(tellkit.TellkitError, match="not tied"):
        conv.convert(bad, num_heads=4)
    with pytest.raises(tellkit.TellkitError, match="num_heads"):
        conv.convert(ref, num_heads=7)
    with pytest.raises(tellkit.TellkitError, match="unknown option"):
        conv.convert(ref, num_heads=4, colour="red")
    torch.save(ref, tmp_path / "best.th")
    res = subprocess.run([sys.executable, "-m", "tellkit", "convert", str(tmp_path / "best.th"),
                          "-o", "num_heads=7", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_plain_weight_linears_are_reparametrised():
    from tellkit.convert import transform_and_tell as conv

    m = tellkit.create_model("tat/tiny", **TINY, contexts=["image", "article", "faces"]).eval()
    random_weights(m)
    ref = reference_state(m)
    w = m.layers[0].fc1.effective_weight().detach()
    for n in ("weight_g", "weight_v"):
        del ref[f"decoder.layers.0.fc1.{n}"]
    ref["decoder.layers.0.fc1.weight"] = w
    _, sd = conv.convert(ref, num_heads=4)
    g, v = sd["layers.0.fc1.weight_g"], sd["layers.0.fc1.weight_v"]
    torch.testing.assert_close(g * v / v.norm(dim=1, keepdim=True), w)


def test_the_checkpoint_resnet_and_its_running_statistics_become_the_image_encoder(tmp_path):
    """best.th holds the reference's ResNet (``resnet.*``, torchvision's layout) with the BatchNorm
    running statistics its training updated (``model.train()``, gradients off): the converted
    model's image encoder must be that network, not the ImageNet one."""
    import json

    from tellkit.checkpoint import read_checkpoint_config
    from tellkit.encoders.resnet import BLOCKS, ResNet
    from tellkit.tasks.captioning import CaptionProcessor

    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", **TINY, contexts=["image", "article", "faces"]).eval()
    net = ResNet(BLOCKS["resnet50"])  # tellkit builds 50 / 101 / 152 alike; 50 keeps the test small
    with torch.no_grad():
        for name, buf in net.named_buffers():
            if name.endswith("running_mean") or name.endswith("running_var"):
                buf.copy_(torch.rand_like(buf) + 0.5)
    ref = {**reference_state(m), **{f"resnet.{k}": v for k, v in net.state_dict().items()}}
    torch.save(ref, tmp_path / "best.th")
    from tellkit.convert import convert_checkpoint

    out = convert_checkpoint(tmp_path / "best.th", tmp_path / "conv", num_heads=4)
    meta = json.loads((out / "config.json").read_text())
    assert (meta["encoders"]["image"], meta["encoders"]["image_weights"]) == ("resnet50", "image_encoder.safetensors")
    moved = tmp_path / "moved"
    out.rename(moved)  # the weights file is found beside the model wherever the folder goes
    enc = CaptionProcessor.recipe_bundle(read_checkpoint_config(moved), ("image",)).image_encoder
    got = enc.backbone.state_dict()
    assert set(got) == set(net.state_dict())
    for k, v in net.state_dict().items():
        assert torch.equal(got[k], v), k
    bad = {**reference_state(m), "resnet.conv1.weight": torch.randn(4, 3, 7, 7)}
    from tellkit.convert import transform_and_tell as conv

    with pytest.raises(tellkit.TellkitError, match="not a ResNet tellkit builds"):
        conv.encoder_files(bad)
