"""COCO-style caption JSON: the official ``captions_<split>.json`` or Karpathy's split file.

- Official: ``{"images": [{"id", "file_name"}], "annotations": [{"id", "image_id", "caption"}]}``
  (one file per split; ``split`` labels its samples).
- Karpathy (``dataset_coco.json`` / ``dataset_flickr8k.json``): ``{"images": [{"filename",
  "filepath"?, "split", "sentences": [{"raw"}], "imgid" | "cocoid"}]}``; ``restval`` counts as
  train unless ``restval="restval"``.
No article: ``paragraphs`` is empty (``context="other_captions"`` puts the image's other
captions there instead).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError


def with_other_captions(samples: list[CaptionSample]) -> list[CaptionSample]:
    """Give each sample the other captions of its image as context paragraphs."""
    by_image: dict[str, list[CaptionSample]] = defaultdict(list)
    for s in samples:
        by_image[s.image_id or s.id].append(s)
    for group in by_image.values():
        for s in group:
            s.paragraphs = [o.caption for o in group if o is not s]
    return samples


def load_coco(path: str | os.PathLike, split: str | None = None, *, image_root: str | os.PathLike | None = None,
              context: str = "none", restval: str = "train") -> list[CaptionSample]:
    path = Path(path)
    if not path.is_file():
        raise TellkitError(f"COCO captions file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TellkitError(f"{path}: not valid JSON ({exc})") from exc
    root = Path(image_root) if image_root else path.parent
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise TellkitError(f"{path}: expected an object with an 'images' list")
    out: list[CaptionSample] = []
    if "annotations" in data:  # official format
        files = {im["id"]: im.get("file_name") for im in data["images"]}
        for ann in data["annotations"]:
            if ann["image_id"] not in files or not str(ann.get("caption", "")).strip():
                continue
            fn = files[ann["image_id"]]
            out.append(CaptionSample(id=str(ann["id"]), caption=ann["caption"].strip(),
                                     image_path=str(root / fn) if fn else None,
                                     image_id=str(ann["image_id"]), split=split, source="coco"))
    else:  # Karpathy
        for im in data["images"]:
            s = im.get("split")
            s = restval if s == "restval" else s
            if split is not None and s != split:
                continue
            rel = Path(im.get("filepath", "")) / im["filename"]
            iid = str(im.get("cocoid", im.get("imgid", im["filename"])))
            for k, sent in enumerate(im.get("sentences", [])):
                text = (sent.get("raw") or " ".join(sent.get("tokens", []))).strip()
                if text:
                    sid = str(sent.get("sentid", f"{iid}#{k}"))
                    out.append(CaptionSample(id=sid, caption=text, image_path=str(root / rel), image_id=iid,
                                             split=s, source="coco"))
    if not out:
        raise TellkitError(f"{path}: no captions for split {split!r}")
    if context == "other_captions":
        with_other_captions(out)
    elif context != "none":
        raise TellkitError(f"COCO context must be 'none' or 'other_captions', got {context!r}")
    return out
