"""`tellkit demo` (what `make demo` runs): caption the packaged sample inputs with the default
captioning model, then read the packaged handwritten-math sample with the default BTTR model.
The samples (``tellkit/assets/demo_caption``, see its SOURCES.md; the math sample is
``tellkit.pipelines.recognition.SAMPLE_PATH``, drawn from hand-made pen strokes) are free to
redistribute; each image is decoded by :func:`tellkit.utils.images.open_image` (through
``encoders.preprocess.load_image``, like every image a user gives) and captioned with its article
when it has one (``<name>.txt``). Until a default captioning model is installed, an untrained
tiny model runs instead, and says so. Every answer is followed by how sure the model is (its
confidence, and the flag ``unsure`` where the input looks unlike what the model learned:
:mod:`tellkit.decoding.confidence`)."""
from __future__ import annotations

import argparse
import json

NAME = "demo"
HELP = "caption the packaged sample images (and articles) and recognise a handwritten formula with the default models"


def add_arguments(p) -> None:
    p.add_argument("--model", metavar="DIR", help="use this captioning checkpoint instead of the default model")
    p.add_argument("--checkpoint", dest="model", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="one JSON object per sample (caption, faces, attention)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--no-math", action="store_true", help="skip the handwritten-math (BTTR) sample")


def run(args) -> int:
    from tellkit.encoders.preprocess import load_image  # heavy
    from tellkit.pipelines.captioning import NO_OBJECT_DETECTOR, CaptioningPipeline  # heavy
    from tellkit.recipes import ASSETS, packaged_default  # heavy

    samples = ASSETS / "demo_caption"
    default = packaged_default("caption")
    if args.model or default:
        captioner = CaptioningPipeline.load(args.model, device=args.device)
        print(f"tellkit demo: captioning with {args.model or default}")
        if not args.model:
            print_model_title(default)
    else:
        print("tellkit demo: NO TRAINED DEFAULT CAPTIONING MODEL IS INSTALLED. Running an UNTRAINED tiny "
              "Transform and Tell (random weights) over the real offline encoders to show the pipeline: "
              "its captions are noise. Pass --model DIR to use a trained model.")
        captioner = CaptioningPipeline.untrained()
    reads_articles = captioner.reads_articles
    if not reads_articles:
        print("(this model captions from the image alone: the sample articles are not used)")
    if "objects" in captioner.contexts:
        print(f"(this model reads objects; {NO_OBJECT_DETECTOR})")
    images = sorted(samples.glob("*.jpg"))
    articles = [img.with_suffix(".txt") for img in images]
    texts = [t.read_text(encoding="utf-8") if t.is_file() and reads_articles else "" for t in articles]
    results = captioner([{"image": load_image(img), "article": text} for img, text in zip(images, texts)],
                        details=args.json)
    for img, txt, article, res in zip(images, articles, texts, results):
        if args.json:
            print(json.dumps({"image": img.name, "article": txt.name if article else None, **res}, ensure_ascii=False))
        else:
            faces = f", {len(res['faces'])} face(s)" if res.get("faces") else ""
            print(f"{img.name}{' + ' + txt.name if article else ''}{faces}: {res['text']}{sureness(res)}")
    if not args.no_math:
        demo_math(args)
    return 0


def demo_math(args) -> None:
    """The packaged handwritten formula through the default BTTR model (`tellkit recognize`)."""
    from tellkit.pipelines.recognition import SAMPLE_LATEX, SAMPLE_PATH, RecognitionPipeline  # heavy
    from tellkit.recipes import PACKAGED_DEFAULTS  # heavy

    rec = RecognitionPipeline.load(None, device=args.device)
    print(f"tellkit demo: handwritten math with {PACKAGED_DEFAULTS['recognize']}")
    print_model_title(PACKAGED_DEFAULTS["recognize"])
    res = rec(SAMPLE_PATH)
    if args.json:
        print(json.dumps({"image": SAMPLE_PATH.name, "truth": SAMPLE_LATEX, **res}, ensure_ascii=False))
    else:
        print(f"{SAMPLE_PATH.name} (drawn: {SAMPLE_LATEX}): {res['text']}{sureness(res)}")


def sureness(res) -> str:
    """How sure the model is, after the answer: ``  [confidence 0.83]`` or
    ``  [unsure (confidence 0.12): this looks unlike what the model learned]``."""
    from tellkit.decoding.confidence import describe  # heavy (torch)

    words = describe(res)
    return f"  [{words}]" if words else ""


def print_model_title(folder) -> None:
    """The first line (title) of a packaged model's README.md, when it has one."""
    about = folder / "README.md"
    if about.is_file():
        print(about.read_text(encoding="utf-8").strip().splitlines()[0].lstrip("# "))
