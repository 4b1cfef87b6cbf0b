"""Faces as the data recorded them: a data set's empty face set stays empty (masked), and only an
image with no face record at all goes to the detector.

The reference readers (``nytimes_faces_ner_matched.py``, ``goodnews_face_ner_matched.py``) build
the face set from the stored ``facenet_details`` and give an empty array when there is none; they
never run a detector while reading a data set."""
import numpy as np
import pytest
import torch

from tellkit.data.batch import collate_captions
from tellkit.data.nytimes import samples_from_article
from tellkit.data.sample import CaptionSample
from tellkit.encoders.bundle import CaptionInput, EncoderBundle, EncodersConfig
from tellkit.errors import TellkitError
from tellkit.tasks.captioning import sample_input


def _reference_face_set(section: dict, n_persons: int = 4) -> np.ndarray:
    # a re-statement of the reference reader's lines
    if "facenet_details" not in section or n_persons == 0:
        return np.array([[]])
    return np.array(section["facenet_details"]["embeddings"][:n_persons])


def _article(sections):
    return {"_id": "a1", "split": "train", "headline": {"main": "T"}, "parsed_section": sections,
            "image_positions": [i for i, s in enumerate(sections) if s["type"] == "caption"]}


def test_a_recorded_empty_face_set_is_never_sent_to_the_detector():
    sections = [
        {"type": "paragraph", "text": "A paragraph."},
        {"type": "caption", "text": "With faces.", "hash": "h1",
         "facenet_details": {"embeddings": (np.arange(5 * 512, dtype=np.float32).reshape(5, 512) / 1e3).tolist()}},
        {"type": "caption", "text": "Empty record.", "hash": "h2", "facenet_details": {"embeddings": []}},
        {"type": "caption", "text": "No record.", "hash": "h3"},
    ]
    samples = {s.id: s for s in samples_from_article(_article(sections))}
    inputs = {k: sample_input(s) for k, s in samples.items()}
    for sec in sections[1:]:
        ref = _reference_face_set(sec)
        got = inputs[sec["hash"]].faces
        assert got is not None  # recorded: never None, so the bundle never detects for a data set
        assert got.size == ref.size and (ref.size == 0 or np.allclose(got, ref))

    # the paper recipe's face encoder needs weights: a data-set sample must not reach it
    bundle = EncoderBundle(EncodersConfig(faces="facenet_vggface2"), contexts=("faces",))
    items = bundle.encode([inputs["h1"], inputs["h2"], inputs["h3"]])
    assert [tuple(i["faces"].shape) for i in items] == [(4, 512), (0, 512), (0, 512)]
    batch = collate_captions([{**i, "caption": torch.tensor([0, 5, 2])} for i in items], contexts=("faces",))
    assert batch["faces_mask"].tolist() == [[True] * 4, [False] * 4, [False] * 4]
    # an image with no record at all (a user's photo) is the one case that detects
    with pytest.raises(TellkitError, match="face_weights"):
        bundle.encode([CaptionInput("photo", image=_blank_image())])


def test_goodnews_release_records_no_faces_so_they_are_detected():
    s = CaptionSample(id="g_0", caption="c", image_path=None, source="goodnews")
    assert sample_input(s).faces is None


def _blank_image():
    from PIL import Image

    return Image.new("RGB", (32, 32))
