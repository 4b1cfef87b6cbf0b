"""How2 summarization data (Sanabria et al. 2018): transcript + video features -> summary.

Two on-disk layouts are read:

- official / MFN layout: ``<folder>/text/<part>/`` with ``*_tran_text.txt`` (transcripts),
  ``*_desc_text.txt`` (summaries) and ``*_action.txt`` (one ``.npy`` path per line, e.g.
  ``../how2data/video_action_features/<id>.npy``), features in ``<folder>/video_action_features/``.
  Parts: ``sum_train``, ``sum_cv``, ``sum_devtest`` and their ASR variants ``sum_asr_*``.
- MCLS demo layout: ``<folder>/<part>_art_en.txt``, ``<part>_sum.txt``, ``<part>_action.txt``
  (one video id per line) and ``<folder>/video_action_features/<id>.npy``.

A part is named ``"<folder>:<part>"`` (folder relative to the data root) or ``"<part>"`` for a
part directly under the root; the layout is detected from the files present. Lines of the text
files are aligned; each feature file is float32 [T, 2048] (one vector per 16 frames from a
Kinetics 3D ResNeXt-101). Features are truncated / padded to ``max_frames`` (256) with a mask,
transcripts truncated to ``max_source_tokens`` (512) tokens, special tokens included
(``source_special_tokens=False``: none, as the reference's data builder), summaries to
``max_target_tokens`` tokens, special tokens included (the reference: 63 summary tokens + EOS).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tellkit.errors import TellkitError

FEATURE_DIR = "video_action_features"


@dataclass(frozen=True)
class How2Example:
    id: str
    transcript: str
    summary: str
    features: Path | None  # the .npy file, or None when the part has no video


def _read_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TellkitError(f"{path}: not UTF-8 text") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":  # final newline
        lines.pop()
    return [ln.rstrip("\r") for ln in lines]


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise TellkitError(f"{folder}: expected exactly one file matching {pattern}, found {len(found)}")
    return found[0]


def _feature_path(folder: Path, text_dir: Path, entry: str) -> Path:
    """Resolve an action-file entry (an id or a path to an .npy) to an existing feature file."""
    name = os.path.basename(entry.strip())
    if not name.endswith(".npy"):
        name += ".npy"
    candidates = [folder / FEATURE_DIR / name]
    if "/" in entry or entry.endswith(".npy"):
        candidates += [text_dir / entry.strip(), folder / entry.strip()]
    for c in candidates:
        if c.is_file():
            return c
    raise TellkitError(f"video features for '{entry.strip()}' not found (looked for {candidates[0]})")


def read_part(root: str | os.PathLike, spec: str, *, with_video: bool = True) -> list[How2Example]:
    """Read one part, e.g. ``"mfn_sample:sum_train"`` or ``"mcls_demo:val"``."""
    root = Path(root)
    folder_name, _, part = spec.rpartition(":")
    folder = root / folder_name if folder_name else root
    if not folder.is_dir():
        raise TellkitError(f"How2 folder not found: {folder}")
    official = folder / "text" / part
    if official.is_dir():
        text_dir = official
        transcripts = _read_lines(_one(official, "*_tran_text.txt"))
        summaries = _read_lines(_one(official, "*_desc_text.txt"))
        actions = _read_lines(_one(official, "*_action.txt"))
    elif (folder / f"{part}_art_en.txt").is_file():
        text_dir = folder
        transcripts = _read_lines(folder / f"{part}_art_en.txt")
        summaries = _read_lines(_existing(folder / f"{part}_sum.txt"))
        actions = _read_lines(_existing(folder / f"{part}_action.txt"))
    else:
        raise TellkitError(
            f"{spec}: neither {official}/ (official How2 layout) nor {folder}/{part}_art_en.txt (demo layout) exists"
        )
    if not (len(transcripts) == len(summaries) == len(actions)):
        raise TellkitError(
            f"{spec}: line counts differ (transcripts {len(transcripts)}, summaries {len(summaries)}, "
            f"videos {len(actions)})"
        )
    out = []
    for tr, su, ac in zip(transcripts, summaries, actions):
        vid = Path(ac.strip()).stem if ac.strip().endswith(".npy") else ac.strip()
        if not vid:
            raise TellkitError(f"{spec}: empty video id in the action file")
        feats = _feature_path(folder, text_dir, ac) if with_video else None
        out.append(How2Example(vid, tr.strip(), su.strip(), feats))
    return out


def _existing(p: Path) -> Path:
    if not p.is_file():
        raise TellkitError(f"missing How2 file: {p}")
    return p


def read_parts(
    root: str | os.PathLike, specs: Sequence[str] | str, *, dedupe: bool = True, with_video: bool = True
) -> list[How2Example]:
    """Concatenate several parts; with ``dedupe`` a video id seen earlier is skipped."""
    if isinstance(specs, str):
        specs = [specs]
    seen: set[str] = set()
    out: list[How2Example] = []
    for spec in specs:
        for ex in read_part(root, spec, with_video=with_video):
            if dedupe and ex.id in seen:
                continue
            seen.add(ex.id)
            out.append(ex)
    return out


def load_features(path: str | os.PathLike, max_frames: int = 256, dim: int | None = None) -> np.ndarray:
    """float32 [min(T, max_frames), D] from an ``.npy`` file (no pickle)."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"video features not found: {p}")
    try:
        arr = np.load(p, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise TellkitError(f"{p}: not a readable .npy array ({exc})") from exc
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise TellkitError(f"{p}: expected features of shape (T, D) with T >= 1, got {arr.shape}")
    if dim is not None and arr.shape[1] != dim:
        raise TellkitError(f"{p}: feature size {arr.shape[1]}, the model expects {dim}")
    if not np.isfinite(arr).all():
        raise TellkitError(f"{p}: features contain NaN or infinity")
    return np.ascontiguousarray(arr[:max_frames], dtype=np.float32)


def pad_video(
    feats: Sequence[np.ndarray | None], dim: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [T_i, D] arrays into [B, M, D] (zero padding) and a bool mask [B, M] (True = real).
    ``length`` fixes M (longer inputs are truncated); default the longest in the batch."""
    m = length if length is not None else max([len(f) for f in feats if f is not None] or [1])
    video = torch.zeros(len(feats), m, dim)
    mask = torch.zeros(len(feats), m, dtype=torch.bool)
    for i, f in enumerate(feats):
        if f is None:
            continue
        t = min(len(f), m)
        video[i, :t] = torch.from_numpy(np.asarray(f[:t], dtype=np.float32))
        mask[i, :t] = True
    return video, mask


def source_ids(tokenizer: Any, transcript: str, *, max_source_tokens: int = 512, source_prefix: str = "",
               source_special_tokens: bool = True) -> list[int]:
    """The model's source tokens for a transcript: ``source_prefix`` + transcript, cut to
    ``max_source_tokens``; the tokenizer's special tokens unless ``source_special_tokens`` is
    false (the reference's data builder encodes transcripts without them)."""
    plain = {} if source_special_tokens else {"add_special_tokens": False}
    enc = tokenizer(source_prefix + transcript, max_length=max_source_tokens, truncation=True, **plain)
    return list(enc["input_ids"])


class How2Dataset(Dataset):
    """Tokenised How2 examples. Items: ``id``, ``input_ids``, ``labels``, ``video``, ``summary``."""

    def __init__(
        self,
        examples: Sequence[How2Example],
        tokenizer: Any,
        *,
        max_source_tokens: int = 512,
        max_target_tokens: int = 128,
        max_frames: int = 256,
        video_dim: int = 2048,
        source_prefix: str = "",
        source_special_tokens: bool = True,
        use_video: bool = True,
    ):
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self.max_source_tokens = max_source_tokens
        self.max_target_tokens = max_target_tokens
        self.max_frames = max_frames
        self.video_dim = video_dim
        self.source_prefix = source_prefix
        self.source_special_tokens = source_special_tokens
        self.use_video = use_video

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        src = source_ids(self.tokenizer, ex.transcript, max_source_tokens=self.max_source_tokens,
                         source_prefix=self.source_prefix, source_special_tokens=self.source_special_tokens)
        tgt = self.tokenizer(ex.summary, max_length=self.max_target_tokens, truncation=True)
        video = None
        if self.use_video and ex.features is not None:
            video = load_features(ex.features, self.max_frames, self.video_dim)
        return {
            "id": ex.id,
            "input_ids": src,
            "labels": list(tgt["input_ids"]),
            "video": video,
            "summary": ex.summary,
        }


def collate_how2(
    samples: Sequence[dict[str, Any]], pad_id: int, *, video_dim: int = 2048, frames: int | None = 256
) -> dict[str, Any]:
    """Pad a list of dataset items into a batch: ``input_ids``/``attention_mask`` [B, L],
    ``labels`` [B, T] (-100 at padding), ``video`` [B, M, D] + ``video_mask`` [B, M] (only when
    the samples carry video), ``ids`` and ``summaries`` (lists)."""
    if not samples:
        raise TellkitError("empty batch")
    b = len(samples)
    L = max(len(s["input_ids"]) for s in samples)
    T = max(len(s["labels"]) for s in samples)
    input_ids = torch.full((b, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, L, dtype=torch.long)
    labels = torch.full((b, T), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = torch.tensor(s["input_ids"], dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, : len(s["labels"])] = torch.tensor(s["labels"], dtype=torch.long)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "ids": [s["id"] for s in samples],
        "summaries": [s.get("summary", "") for s in samples],
    }
    if any(s.get("video") is not None for s in samples):
        batch["video"], batch["video_mask"] = pad_video([s.get("video") for s in samples], video_dim, frames)
    return batch
