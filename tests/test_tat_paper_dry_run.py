"""Each paper recipe of docs/transform_and_tell.md runs as written once its weights are given: the
documented overrides with encoders of the paper's shapes and random values (ResNet-152
``encoders.image_weights=random``; a FaceNet file in facenet-pytorch's layout; a folder in
RoBERTa-large's layout, 24 layers x 1024), data in the recipe's format (the GoodNews and
NYTimes800k fixtures), the paper-size model built, one training step taken with the recipe's
optimiser, the encoders run in the step as the reference ran them."""
import math
from pathlib import Path

import pytest
import torch

from tellkit.config import deep_merge, load_yaml, parse_overrides

FIX = Path(__file__).parent / "fixtures"

# the documented command of each paper recipe, its data in the fixtures' places
RECIPES = {
    "tat/goodnews": [f"data.root={FIX / 'goodnews'}"],
    "tat/nytimes_faces": [f"data.root={FIX / 'nytimes' / 'nytimes_tiny.archive.gz'}",
                          f"data.options={{image_root: {FIX / 'nytimes' / 'images_processed'}}}"],
    "tat/nytimes_full": [f"data.root={FIX / 'nytimes' / 'nytimes_tiny.archive.gz'}",
                         f"data.options={{image_root: {FIX / 'nytimes' / 'images_processed'}, objects: true}}"],
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Random weights at the paper encoders' shapes, as local files a user would pass."""
    from transformers import RobertaConfig, RobertaModel

    from tellkit.encoders.faces.facenet import InceptionResnetV1
    from tellkit.encoders.tokenizer import CaptionTokenizer

    d = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    torch.save(InceptionResnetV1().state_dict(), d / "vggface2.pt")
    CaptionTokenizer.load().save_pretrained(d / "roberta")
    cfg = RobertaConfig(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=16, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2)
    RobertaModel(cfg).save_pretrained(d / "roberta")
    return {"encoders.image_weights": "random", "encoders.face_weights": str(d / "vggface2.pt"),
            "encoders.article": str(d / "roberta")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_paper_recipe_builds_and_takes_one_training_step(name, weights):
    from tellkit.recipes import train_config
    from tellkit.tasks import make_task
    from tellkit.training.loop import build_optimizer

    overrides = [*RECIPES[name], *(f"{k}={v}" for k, v in weights.items()), "train.batch_size=2"]
    recipe = deep_merge(load_yaml(name), parse_overrides(overrides))
    task = make_task(recipe)
    torch.manual_seed(0)
    model = task.build_model()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n_params == (200_461_337 if name == "tat/nytimes_full" else 171_068_441)
    task.bundle.check_model(model.config)  # the encoders give what the paper-size model reads
    dataset = task.build_dataset("train")
    batch = task.collate([dataset[i] for i in range(min(2, len(dataset)))])
    model.train()
    task.bundle.train(True)
    batch = task.training_batch(task.on_device(batch, model), model)
    assert batch["image"].shape[1:] == (49, 2048) and batch["article"].shape[1] == 25
    assert batch["article"].shape[-1] == 1024 and batch["faces"].shape[-1] == 512
    if name == "tat/nytimes_full":
        assert batch["objects"].shape[-1] == 2048
    cfg = train_config(recipe)
    optimizer = build_optimizer(cfg, task.param_groups(model, cfg.lr))
    before = model.layers[0].fc1.weight_v.detach().clone()
    loss = model(batch)["loss"]
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    optimizer.step()
    assert not torch.equal(before, model.layers[0].fc1.weight_v.detach())
