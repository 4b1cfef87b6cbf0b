"""`tellkit features OUT`: pre-compute image grids, face embeddings and (optionally) article
hidden states into shards under OUT (see tellkit.encoders.features for the layout).

    tellkit features feats/ --images photos/                 # a folder or a list of paths
    tellkit features feats/ --format goodnews --root data/goodnews --split val --article
    tellkit features feats/ --images photos/ --image-encoder resnet152 --image-weights r152.pth
    tellkit features feats/ --images photos/ --image-encoder resnet152 --image-weights r152.pth \
        --objects --object-weights yolov3.weights          # + YOLOv3 objects, as the reference's

Re-running the same command resumes after the last finished shard. Several processes share one
OUT: ``--shard I/N`` (or torchrun / a Slurm job array, read from the environment) gives process I
the shards k with k % N == I, and each shard is claimed with a lock file
(:mod:`tellkit.encoders.shards`); the summary ends with the check that every shard exists. Photos
a data set's loader leaves out (GoodNews: an empty caption) are counted as skipped. Images are decoded by
:func:`tellkit.utils.images.open_image` (format and pixel cap checked from the header, so a
decompression bomb is refused before any pixel is decoded); unreadable images are reported and
skipped, and the summary (also in OUT/features.json) counts them by reason. An OUT that is not a
folder, or an image list that is not UTF-8 text, is a one-line error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tellkit.cli import positive_int
from tellkit.errors import TellkitError

NAME = "features"
HELP = "pre-compute image grids, face embeddings and article hidden states into shards (resumable)"


def add_arguments(p) -> None:
    p.add_argument("out", help="output folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="a folder of images (recursive) or a text file listing image paths")
    src.add_argument("--format", choices=("goodnews", "nytimes800k", "coco", "flickr8k"), help="a captioning data set")
    p.add_argument("--root", help="the data set's folder / archive / URI (with --format)")
    p.add_argument("--split", help="only this split (train / val / test) of --format data")
    p.add_argument("--image-root", help="the images' folder for --format data (default: the loader's own)")
    p.add_argument("--limit", type=int, help="only the first N images")
    p.add_argument("--image-encoder",
                   help="mobilenet_v2 (offline default), efficientnet_lite0/1/2 (offline), resnet50/101/152 "
                        "(with --image-weights)")
    p.add_argument("--image-weights", help="a state dict in the image encoder's layout (default: its offline one)")
    p.add_argument("--image-fit", choices=("crop", "squash"),
                   help="how a photo becomes the encoder's square input: crop (default: short side, centre "
                        "crop) or squash (the whole photo, aspect ratio not kept)")
    p.add_argument("--no-faces", action="store_true", help="skip face detection and embedding")
    p.add_argument("--facenet-weights",
                   help="facenet-pytorch-layout FaceNet file (e.g. VGGFace2); default: packaged CASIA-WebFace")
    p.add_argument("--max-faces", type=int, help="most faces kept per image, largest first (default: 4)")
    p.add_argument("--article", action="store_true", help="also store article hidden states (all layers; large)")
    p.add_argument("--article-encoder",
                   help="Hugging Face name or folder (default: packaged all-MiniLM-L6-v2), or static word "
                        "vectors: static (MiniLM input embeddings), static:NAME, glove:PATH")
    p.add_argument("--max-article-tokens", type=int, default=512,
                   help="the article encoder's token budget, special tokens included (default: 512)")
    p.add_argument("--context-policy", default="reference", choices=("reference", "cut"),
                   help="which article text is read: the reference's rules (default) or a compact builder (cut)")
    p.add_argument("--objects", action="store_true",
                   help="also store object vectors: those the data set ships (NYTimes800k), else YOLOv3 + ResNet-152 "
                        "detected in the images (needs --object-weights)")
    p.add_argument("--object-weights", help="darknet's yolov3.weights (the darknet release): detect the objects of "
                                            "images that come without vectors (encoders.object_weights)")
    p.add_argument("--object-cfg", help="the detector's darknet .cfg (default: yolov3.cfg's layout, built in)")
    p.add_argument("--object-resnet-weights",
                   help="ResNet-152 state dict for the object crops (default: --image-weights with resnet152)")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32", "bfloat16"), help="storage dtype")
    p.add_argument("--shard-size", type=int, default=256, help="images per shard (the unit of resumption)")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--max-pixels", type=int, help="skip images with more pixels (decompression-bomb guard)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--shard", metavar="I/N",
                   help="compute only shards k with k %% N == I (process I of N on one OUT; default: from torchrun's "
                        "RANK / WORLD_SIZE or a Slurm job array, else every shard); each shard is claimed with a "
                        "lock file, so processes never compute the same one")
    p.add_argument("--overwrite", action="store_true", help="discard features already in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from tellkit.encoders.bundle import EncodersConfig  # heavy
    from tellkit.encoders.features import FeatureConfig, extract_features, items_from_images  # heavy

    check_out(Path(args.out))
    if args.images:
        check_image_list(Path(args.images))
    if args.format and not args.root:
        raise TellkitError("--format needs --root (the data set's location)")
    if args.images and (args.root or args.split or args.image_root):
        raise TellkitError("--root/--split/--image-root go with --format, not --images")
    from tellkit.utils.precision import resolve_device  # heavy

    device = str(resolve_device(args.device))  # one line for an unknown device or a GPU this machine lacks
    if args.threads:
        import torch  # heavy

        torch.set_num_threads(args.threads)
    dropped: list[dict] = []  # photos the data set's loader leaves out (with the reason)
    if args.images:
        items = items_from_images(args.images)
        if args.limit:
            items = items[: args.limit]
    else:
        from tellkit.tasks.captioning import dataset_inputs  # heavy

        shipped = args.objects and (args.format == "nytimes800k" or not args.object_weights)
        items = dataset_inputs(args.format, args.root, args.split, args.limit, args.image_root, objects=shipped,
                               dropped=dropped)
    if args.article and args.images:
        print("note: --images gives no article text; article features will be empty", file=sys.stderr)
    if (args.object_weights or args.object_cfg or args.object_resnet_weights) and not args.objects:
        raise TellkitError("--object-weights / --object-cfg / --object-resnet-weights go with --objects")
    if args.objects and args.images and not args.object_weights:
        raise TellkitError("--objects on --images detects them with YOLOv3: give --object-weights yolov3.weights "
                           "(the darknet release, https://pjreddie.com/media/files/yolov3.weights)")
    given = {"image": args.image_encoder, "image_weights": args.image_weights, "image_fit": args.image_fit,
             "article": args.article_encoder,
             "face_weights": args.facenet_weights, "max_faces": args.max_faces,
             "object_weights": args.object_weights, "object_cfg": args.object_cfg,
             "object_resnet_weights": args.object_resnet_weights}
    encoders = EncodersConfig.from_recipe({k: v for k, v in given.items() if v is not None})
    cfg = FeatureConfig(
        encoders=encoders, faces=not args.no_faces, article=args.article, objects=args.objects,
        max_article_tokens=args.max_article_tokens, context_policy=args.context_policy, dtype=args.dtype,
        shard_size=args.shard_size, batch_size=args.batch_size, max_pixels=args.max_pixels, device=device,
    )
    from tellkit.encoders.shards import shard_spec  # heavy

    summary = extract_features(items, args.out, cfg, overwrite=args.overwrite, progress=not args.no_progress,
                               log=lambda msg: print(msg, file=sys.stderr, flush=True), dropped=dropped,
                               shard=shard_spec(args.shard))
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(summary["skipped_by_reason"].items())) or "none"
    speed = f", {summary['seconds_per_image']:.3f} s/image" if summary["seconds_per_image"] else ""
    print(f"features: {summary['encoded']} of {summary['items']} images in {Path(args.out)} "
          f"({summary['shards']} shards: {summary['shards_written']} written, {summary['shards_reused']} reused; "
          f"{summary['seconds']:.1f} s{speed})")
    if summary["complete"]:
        print(f"shards: all {summary['shards']} present")
    else:
        print(f"shards: {summary['missing_shards']} of {summary['shards']} not yet written (other processes' shards, "
              "or run again to compute them)")
    print(f"skipped: {summary['skipped']} ({reasons})")
    for s in summary["skipped_items"][:20]:
        print(f"  {s['id']}: {s['message']}")
    if summary["skipped"] > 20:
        print(f"  ... {summary['skipped'] - 20} more in {Path(args.out) / 'features.json'}")
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped_items"}))
    return 0


def check_out(out) -> None:
    """OUT must be a folder or not exist yet (nor any of its parents be a file)."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "OUT" if p == out else f"OUT's parent {p}"
                raise TellkitError(f"{out}: {what} is a file, expected a folder for the feature shards")
            return


def check_image_list(path) -> None:
    """A file given to --images must be a UTF-8 text list of image paths (one per line)."""
    if not path.is_file():
        return  # a folder, or missing: items_from_images says which
    data = path.read_bytes()
    try:
        data.decode("utf-8")
        bad = data.find(b"\0")
    except UnicodeDecodeError as exc:
        bad = exc.start
    if bad >= 0:
        raise TellkitError(f"{path}: not a text list of image paths (binary data at byte {bad}); "
                           "--images takes a folder or a UTF-8 file with one image path per line")
