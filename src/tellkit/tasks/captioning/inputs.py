"""Captioning inputs: a data set's samples and a pasted article as the encoder bundle's
:class:`~tellkit.encoders.bundle.CaptionInput`."""
from __future__ import annotations

import re
from pathlib import Path

from tellkit.data import load_captions
from tellkit.data.sample import CaptionSample
from tellkit.encoders.bundle import CaptionInput
from tellkit.errors import TellkitError


def sample_input(s: CaptionSample, context_mode: str = "location_aware") -> CaptionInput:
    """A data sample as the bundle's input (one per image: the id is the image's), with the
    precomputed face / object sets it ships, and its article shaped for ``context_mode``."""
    where = s.image_position if context_mode == "location_aware" else None
    none = context_mode == "none"
    # a recorded face set, even an empty one, is what the data set found; None (no record): detect
    return CaptionInput(s.image_id or s.id, s.image_path, "" if none else s.title, [] if none else list(s.paragraphs),
                        where, faces=s.extra.get("faces"), objects=s.extra.get("objects"), from_dataset=True)


def dataset_inputs(fmt: str, root: str, split: str | None = None, limit: int | None = None,
                   image_root: str | None = None, objects: bool = False,
                   dropped: list[dict] | None = None) -> list[CaptionInput]:
    """One input per distinct image of a captioning data set (``tellkit features --format``),
    with its article context (title, paragraphs, image position) and precomputed sets.
    ``image_root``: the images' folder (NYTimes800k default: ``images_processed`` beside the archive);
    ``objects``: also read the object vectors the data set ships (NYTimes800k); ``dropped``
    receives the photos the loader leaves out, with the reason (GoodNews: empty captions)."""
    options: dict = {"dropped": dropped} if dropped is not None and fmt == "goodnews" else {}
    if objects:
        if fmt != "nytimes800k":
            raise TellkitError(f"the {fmt} data ships no object vectors (--objects is for nytimes800k)")
        options["objects"] = True
    if fmt == "nytimes800k":
        beside = Path(root).parent / "images_processed"
        options["image_root"] = image_root or (beside if beside.is_dir() else None)
    elif image_root is not None:
        key = {"goodnews": "images_dir", "coco": "image_root"}.get(fmt)
        if key is None:
            raise TellkitError(f"--image-root is not used by the {fmt} loader")
        options[key] = str(Path(image_root).resolve())
    seen: dict[str, CaptionInput] = {}
    for s in load_captions(fmt, root, split, **options):
        key = s.image_id or s.id
        if key not in seen and s.image_path:
            seen[key] = sample_input(s)
        if limit is not None and len(seen) >= limit:
            break
    if not seen:
        raise TellkitError(f"{root}: no images in the {fmt} data" + (f" ({split} split)" if split else "")
                           + ("" if options.get("image_root", True) else "; pass --image-root"))
    return list(seen.values())


def article_input(text: str, image=None, image_path: str | None = None, id: str = "input") -> CaptionInput:
    """A pasted article as the bundle's input: paragraphs are the blocks between blank lines (or
    the lines, when there are none); no title, no image position, so the model reads the
    article from its start up to the encoder's token budget."""
    text = (text or "").strip()
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    if len(blocks) <= 1:
        blocks = [b for b in text.splitlines() if b.strip()]
    return CaptionInput(id, image_path=image_path, paragraphs=blocks, image=image)
