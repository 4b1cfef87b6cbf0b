"""Pre-computed encoder outputs on disk: ``tellkit features`` writes them, training reads them.

    items = items_from_images("photos/")       # or tellkit.tasks.captioning.dataset_inputs(...)
    summary = extract_features(items, "feats/", FeatureConfig(article=True))
    store = FeatureStore("feats/")
    store["<image id>"] -> {"image": float[N, C], "image_mask": bool[N],
                            "faces": float[F, 512], "face_boxes": float[F, 4], "face_probs": float[F],
                            "objects": float[O, 2048],            # only when extracted (precomputed sets)
                            "article": float[n_layers, L, D], "article_mask": bool[L],
                            "article_ids": long[L]}                 # article keys only when extracted

Items are :class:`~tellkit.encoders.bundle.CaptionInput` (``FeatureItem`` is the same class)
and are encoded by :class:`~tellkit.encoders.bundle.EncoderBundle`, the routine training and
inference use, so cached and freshly encoded features are the same (up to the storage dtype).
Precomputed faces / objects of an input are stored as given.

Layout of the output folder:
- ``features.json``: the configuration, the item count, a hash of the item ids, and (once
  finished) the summary. Re-running with a different configuration or item list is refused
  (pass ``overwrite=True`` to start over).
- ``shard-00000.safetensors``, ...: shard k holds items ``[k * shard_size, (k + 1) * shard_size)``
  of the (stable) item list; its metadata lists the ids it holds and the items it skipped with
  the reason. Each shard is written to a temporary file and renamed, so an interrupted run
  resumes at the first missing shard and never reads a half-written one.

An image that cannot be read (missing, not an image, corrupt or truncated, too many pixels) is
reported and skipped; the summary counts skipped items by reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from tellkit.encoders import shards
from tellkit.encoders.bundle import FACE_DIM, OBJECT_DIM, CaptionInput, EncoderBundle, EncodersConfig
from tellkit.encoders.preprocess import ImageLoadError, load_image
from tellkit.errors import TellkitError
from tellkit.utils.precision import resolve_device

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
FORMAT_VERSION = 1
FeatureItem = CaptionInput  # the items of a feature folder are the bundle's inputs


@dataclass
class FeatureConfig:
    """What to extract: the encoders (a recipe's ``encoders:`` section), which context sets,
    and how to store them."""

    encoders: EncodersConfig = field(default_factory=EncodersConfig)
    faces: bool = True
    article: bool = False
    # store object vectors: the inputs' own, else detected when encoders.object_weights is given
    objects: bool = False
    max_article_tokens: int = 512  # the article encoder's budget, special tokens included
    context_policy: str = "reference"  # how the article context is chosen (tellkit.encoders.context)
    dtype: str = "float16"  # storage dtype of the float features
    shard_size: int = 256
    batch_size: int = 16
    max_pixels: int | None = None
    device: str | None = None  # None: the GPU when one is present, else the CPU (resolve_device)

    @property
    def contexts(self) -> tuple[str, ...]:
        return ("image",) + tuple(n for n in ("faces", "article", "objects") if getattr(self, n))

    def identity(self) -> dict:
        """The fields that decide what is stored (batch size and device do not), in the layout
        of format 1; settings added later appear only when they differ from their default, so
        folders written before them stay valid."""
        e = self.encoders
        d = {"image_encoder": e.image, "image_weights": e.image_weights, "faces": self.faces,
             "facenet_weights": e.face_weights, "article": self.article,
             "article_encoder": None if e.article_is_packaged else e.article,
             "dtype": self.dtype, "shard_size": self.shard_size, "max_pixels": self.max_pixels}
        later = {"objects": (self.objects, False), "max_article_tokens": (self.max_article_tokens, 512),
                 "max_faces": (e.max_faces, EncodersConfig.max_faces),
                 "face_standardization": (e.face_standardization, None),
                 "image_fit": (e.image_fit, EncodersConfig.image_fit),
                 "dataset_images": (e.dataset_images, EncodersConfig.dataset_images),
                 "object_weights": (e.object_weights if self.objects else None, None),
                 "object_cfg": (e.object_cfg if self.objects else None, None),
                 "object_resnet_weights": (e.object_resnet_weights if self.objects else None, None)}
        d.update({k: v for k, (v, default) in later.items() if v != default})
        if self.article:  # article states made by another context policy are not reused
            d["context_policy"] = self.context_policy
        return d


# --- inputs --------------------------------------------------------------------------------

def items_from_images(path: str | os.PathLike) -> list[CaptionInput]:
    """A folder (searched recursively for images; id = path relative to it, without suffix) or
    a text file listing image paths, one per line (relative to the file's folder)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        items = [FeatureItem(f.relative_to(p).with_suffix("").as_posix(), str(f)) for f in files]
    elif p.is_file():
        lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines()]
        paths = [Path(ln) if Path(ln).is_absolute() else p.parent / ln for ln in lines if ln and not ln.startswith("#")]
        items = [FeatureItem(q.with_suffix("").name, str(q)) for q in paths]
    else:
        raise TellkitError(f"{p}: no such folder or image list" if not p.exists()
                           else f"{p}: not a folder or a regular file (--images takes a folder or an image list)")
    if not items:
        raise TellkitError(f"{p}: no images found ({', '.join(IMAGE_SUFFIXES)})")
    dup = [k for k, n in Counter(i.id for i in items).items() if n > 1]
    if dup:
        raise TellkitError(f"{p}: {len(dup)} image ids occur twice (e.g. '{dup[0]}')")
    return items


# --- writing -------------------------------------------------------------------------------

def _ids_hash(items: Sequence[FeatureItem]) -> str:
    h = hashlib.sha1()
    for it in items:
        h.update(it.id.encode("utf-8") + b"\0")
    return h.hexdigest()


def _shard_path(out: Path, k: int) -> Path:
    return out / f"shard-{k:05d}.safetensors"


def _read_meta(path: Path) -> dict | None:
    from safetensors import safe_open  # heavy

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return {"ids": json.loads(meta["ids"]), "skipped": json.loads(meta.get("skipped", "[]"))}
    except Exception:  # noqa: BLE001 - an unreadable shard is simply redone
        return None


def _bundle(cfg: FeatureConfig) -> EncoderBundle:
    # items carry the article context already shaped by the caller (paragraphs, image position)
    return EncoderBundle(cfg.encoders, cfg.contexts, max_article_tokens=cfg.max_article_tokens,
                         context_mode="location_aware", context_policy=cfg.context_policy,
                         device=resolve_device(cfg.device))


def _encode_shard(items: Sequence[CaptionInput], bundle: EncoderBundle, cfg: FeatureConfig,
                  on_item: Callable[[CaptionInput, str | None], None],
                  ) -> tuple[dict[str, torch.Tensor], list[str], list[dict]]:
    dtype = getattr(torch, cfg.dtype)
    K = bundle.config.max_faces
    ids: list[str] = []
    skipped: list[dict] = []
    grids, faces, boxes, probs, counts = [], [], [], [], []
    objects, obj_lens = [], []
    art_states, art_ids, art_lens = [], [], []
    for start in range(0, len(items), cfg.batch_size):
        batch = items[start:start + cfg.batch_size]
        ok = []
        for it in batch:
            try:
                ok.append(replace(it, image=load_image(it.image_path, cfg.max_pixels)))
            except ImageLoadError as exc:
                skipped.append({"id": it.id, "path": it.image_path, "reason": exc.reason, "message": str(exc)})
                on_item(it, str(exc))
        if not ok:
            continue
        for it, enc in zip(ok, bundle.encode(ok)):
            grids.append(enc["image"].to(dtype))
            if cfg.faces:
                F, pad = len(enc["faces"]), K - len(enc["faces"])
                known = enc["face_boxes"] is not None
                faces.append(torch.cat([enc["faces"], torch.zeros(pad, FACE_DIM)]).to(dtype))
                boxes.append(torch.cat([enc["face_boxes"] if known else torch.zeros(F, 4), torch.zeros(pad, 4)]))
                probs.append(torch.cat([enc["face_probs"] if known else torch.zeros(F), torch.zeros(pad)]))
                counts.append(F)
            if cfg.objects:
                objects.append(enc["objects"].to(dtype))
                obj_lens.append(len(enc["objects"]))
            if cfg.article:
                n = enc["article"].shape[1]
                art_states.append(enc["article"].transpose(0, 1).to(dtype))  # [L, layers, D]
                art_ids.append(enc["article_ids"].to(torch.int32))
                art_lens.append(n)
            ids.append(it.id)
        for it in ok:
            on_item(it, None)
    C = bundle.image_encoder.out_dim
    tensors = {"image": torch.stack(grids) if grids else torch.zeros(0, 0, C, dtype=dtype)}
    if cfg.faces:
        tensors["faces"] = torch.stack(faces) if faces else torch.zeros(0, K, FACE_DIM, dtype=dtype)
        tensors["face_boxes"] = torch.stack(boxes) if boxes else torch.zeros(0, K, 4)
        tensors["face_probs"] = torch.stack(probs) if probs else torch.zeros(0, K)
        tensors["face_count"] = torch.tensor(counts, dtype=torch.int32)
    if cfg.objects:
        tensors["objects"] = torch.cat(objects) if objects else torch.zeros(0, OBJECT_DIM, dtype=dtype)
        tensors["object_offsets"] = _offsets(obj_lens)
    if cfg.article:
        a = bundle.article_encoder
        tensors["article"] = torch.cat(art_states) if art_states else torch.zeros(0, a.num_layers, a.dim, dtype=dtype)
        tensors["article_ids"] = torch.cat(art_ids) if art_ids else torch.zeros(0, dtype=torch.int32)
        tensors["article_offsets"] = _offsets(art_lens)
    return {k: v.contiguous() for k, v in tensors.items()}, ids, skipped


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def extract_features(items: Sequence[FeatureItem], out_dir: str | os.PathLike, cfg: FeatureConfig | None = None,
                     *, overwrite: bool = False, progress: bool = True,
                     log: Callable[[str], None] | None = None, dropped: Sequence[dict] = (),
                     shard: tuple[int, int] | None = None,
                     check: Callable[[EncoderBundle], None] | None = None) -> dict:
    """Encode ``items`` into shards under ``out_dir`` (resuming a previous run); returns the summary.
    ``dropped``: photos the data set's loader left out before extraction ({"id", "path",
    "reason", "message"}, e.g. an empty caption), counted with the skipped ones. ``shard`` (I, N):
    this process computes only shards k with k % N == I (:mod:`tellkit.encoders.shards`); every
    shard is claimed with a lock file first, so processes sharing ``out_dir`` never compute the
    same one. ``check``: called with the encoders before the first image is encoded (a model's
    size check: nothing is extracted for a model the encoders do not fit). The summary's
    ``complete`` says whether every shard exists once this process is done
    (``missing_shards``: how many do not: other processes' or not yet computed)."""
    from safetensors.torch import save_file  # heavy

    cfg = cfg or FeatureConfig()
    if cfg.shard_size < 1 or cfg.batch_size < 1:
        raise TellkitError("shard_size and batch_size must be positive")
    if cfg.dtype not in ("float16", "float32", "bfloat16"):
        raise TellkitError(f"dtype must be float16, float32 or bfloat16, not {cfg.dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = {"version": FORMAT_VERSION, "config": cfg.identity(), "n_items": len(items), "ids_sha1": _ids_hash(items)}
    index_path = out / "features.json"
    if index_path.exists() and not overwrite:
        old = json.loads(index_path.read_text(encoding="utf-8"))
        if {k: old.get(k) for k in header} != header:
            raise TellkitError(f"{out} holds features of another configuration or item list; "
                               "use another output folder or --overwrite")
    if overwrite:
        if shard is not None:
            raise TellkitError("overwrite with a shard of the work would discard the other processes' shards")
        for f in (*out.glob("shard-*.safetensors"), *out.glob("shard-*.lock")):
            f.unlink()
    _write_index(index_path, header)

    n_shards = (len(items) + cfg.shard_size - 1) // cfg.shard_size
    mine = [k for k in range(n_shards) if shard is None or k % shard[1] == shard[0]]
    done = _done_shards(out, mine)
    already = sum(min(cfg.shard_size, len(items) - k * cfg.shard_size) for k in done)
    total = sum(min(cfg.shard_size, len(items) - k * cfg.shard_size) for k in mine)
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=already, unit="img", desc="features", disable=not progress, dynamic_ncols=True)
    say = log or (lambda msg: tqdm.write(msg))

    def on_item(item: FeatureItem, error: str | None) -> None:
        if error:
            say(f"skipped {item.id}: {error}")
        bar.update(1)

    bundle = None
    written = 0
    encoded_now = 0
    encode_seconds = 0.0  # time spent encoding (model loading excluded)
    try:
        for k in mine:
            path = _shard_path(out, k)
            if k in done or path.exists() or not shards.claim(path):  # done, or another process's
                continue
            try:
                if path.exists():  # finished by another process since the scan
                    continue
                if bundle is None:
                    bundle = _bundle(cfg)
                    if check is not None:
                        check(bundle)
                chunk = items[k * cfg.shard_size:(k + 1) * cfg.shard_size]
                t1 = time.perf_counter()
                tensors, ids, skipped = _encode_shard(chunk, bundle, cfg, on_item)
                encode_seconds += time.perf_counter() - t1
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                save_file(tensors, str(tmp), metadata={"ids": json.dumps(ids), "skipped": json.dumps(skipped)})
                os.replace(tmp, path)
            finally:
                shards.release(path)
            done[k] = {"ids": ids, "skipped": skipped}
            written += 1
            encoded_now += len(ids)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    done = _done_shards(out, range(n_shards))  # the final check: every shard, whoever wrote it
    skipped_all = [*dropped, *(s for k in sorted(done) for s in done[k]["skipped"])]
    summary = {
        "items": len(items) + len(dropped),
        "encoded": sum(len(m["ids"]) for m in done.values()),
        "skipped": len(skipped_all),
        "skipped_by_reason": dict(Counter(s["reason"] for s in skipped_all)),
        "skipped_items": skipped_all,
        "shards": n_shards,
        "shards_written": written,
        "shards_reused": len(done) - written,
        "missing_shards": n_shards - len(done),
        "complete": len(done) == n_shards,
        "shard": f"{shard[0]}/{shard[1]}" if shard is not None else None,
        "seconds": round(seconds, 3),
        "seconds_per_image": round(encode_seconds / encoded_now, 4) if encoded_now else None,
    }
    if summary["complete"]:
        _write_index(index_path, {**header, "summary": summary})
    return summary


def _write_index(path: Path, data: dict) -> None:
    """features.json, replaced atomically (processes sharing the folder write the same header)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def _done_shards(out: Path, ks: Iterable[int]) -> dict[int, dict]:
    """{k: the shard's ids and skipped items} for each readable shard file among ``ks``."""
    found = {k: _read_meta(_shard_path(out, k)) for k in ks if _shard_path(out, k).exists()}
    return {k: m for k, m in found.items() if m is not None}


# --- reading -------------------------------------------------------------------------------

class FeatureStore:
    """Read-only access to a folder written by :func:`extract_features`, by item id."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        index = self.dir / "features.json"
        if not index.is_file():
            raise TellkitError(f"{self.dir}: no features.json (not written by `tellkit features`)")
        self.header = json.loads(index.read_text(encoding="utf-8"))
        self.config = self.header["config"]
        self._where: dict[str, tuple[Path, int]] = {}
        self.skipped: list[dict] = []
        for path in sorted(self.dir.glob("shard-*.safetensors")):
            meta = _read_meta(path)
            if meta is None:
                raise TellkitError(f"{path}: unreadable feature shard")
            for row, item_id in enumerate(meta["ids"]):
                self._where[item_id] = (path, row)
            self.skipped += meta["skipped"]

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._where

    @property
    def ids(self) -> list[str]:
        return list(self._where)

    def __getitem__(self, item_id: str) -> dict[str, torch.Tensor]:
        from safetensors import safe_open  # heavy

        if item_id not in self._where:
            raise KeyError(item_id)
        path, row = self._where[item_id]
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())

            def row_of(name):
                return f.get_slice(name)[row:row + 1][0]

            out["image"] = row_of("image").float()
            out["image_mask"] = torch.ones(out["image"].shape[0], dtype=torch.bool)
            if "faces" in keys:
                n = int(row_of("face_count"))
                out["faces"] = row_of("faces")[:n].float()
                out["face_boxes"] = row_of("face_boxes")[:n]
                out["face_probs"] = row_of("face_probs")[:n]
            if "objects" in keys:
                s, e = (int(v) for v in f.get_slice("object_offsets")[row:row + 2])
                out["objects"] = f.get_slice("objects")[s:e].float()
            if "article" in keys:
                s, e = (int(v) for v in f.get_slice("article_offsets")[row:row + 2])
                out["article"] = f.get_slice("article")[s:e].float().transpose(0, 1).contiguous()  # [layers, L, D]
                out["article_mask"] = torch.ones(e - s, dtype=torch.bool)
                out["article_ids"] = f.get_slice("article_ids")[s:e].long()
        return out

    def items(self) -> Iterable[tuple[str, dict[str, torch.Tensor]]]:
        for item_id in self._where:
            yield item_id, self[item_id]
