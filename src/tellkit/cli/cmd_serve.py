"""`tellkit serve [--host 127.0.0.1] [--port 8000] [--model caption=DIR] [--model recognize=DIR] [--dtype bf16]
[--runtime torch|onnx]`:
the HTTP JSON API and the demo page (see docs/server.md)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from tellkit.cli import add_dtype_argument, add_encoder_argument, add_runtime_argument, encoder_overrides
from tellkit.errors import TellkitError
from tellkit.utils.memory import limit_arenas

NAME = "serve"
HELP = "serve the captioning / handwritten-math API and demo page over HTTP (localhost by default)"


def add_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", "--checkpoint", dest="checkpoint", action="append", default=[],
                   metavar="TASK=DIR",
                   help="checkpoint (or run folder) per task: caption=DIR (a captioner), recognize=DIR (BTTR, "
                        "CoMER); repeatable. Only these (and the packaged defaults) are ever loaded; "
                        "clients cannot choose paths")
    p.add_argument("--models", default="caption,recognize",
                   help="which tasks to serve: caption, recognize or both (default caption,recognize)")
    p.add_argument("--untrained", action="store_true",
                   help="serve tiny RANDOM models (outputs are noise) for the endpoints without --model: "
                        "try the page and API without trained models")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    add_dtype_argument(p)
    add_runtime_argument(p)
    p.add_argument("--max-batch", type=int, default=8, help="requests grouped into one forward pass (default 8)")
    p.add_argument("--max-wait-ms", type=float, default=10.0,
                   help="how long the worker waits to fill a batch (default 10)")
    add_limit_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--api-only", action="store_true", help="serve the API without the page")
    add_encoder_argument(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


# the flags that set a field of tellkit.server.limits.Limits: flag -> (field, type, help); each
# default (and the default the help prints) is the field's own, so a default lives in one place
LIMIT_OPTIONS = {
    "--timeout": ("request_timeout_s", float, "per-request timeout in seconds"),
    "--max-upload-mb": ("max_upload_bytes", float, "request body limit in MiB"),
    "--max-image-pixels": ("max_image_pixels", int, "image width x height limit"),
    "--max-article-chars": ("max_article_chars", int, "article length limit"),
    "--max-decoding": ("max_decoding", int, "images decoded at once; each holds up to ~100 MiB at the default pixel "
                       "limit"),
    "--decode-timeout": ("decode_timeout_s", float, "seconds one uploaded image's decoding may take; past it "
                         "the request gets 422 image_too_complex and the decoder moves on"),
    "--header-timeout": ("header_timeout_s", float, "seconds for a request's line and headers to arrive"),
    "--body-idle-timeout": ("body_idle_timeout_s", float, "longest silence in seconds while a request body arrives"),
    "--body-timeout": ("body_timeout_s", float, "seconds for a whole request body to arrive"),
    "--max-beam-size": ("max_beam_size", int, "widest beam served; a checkpoint's wider one is lowered to it"),
    "--max-gen-len": ("max_gen_len", int, "most tokens generated per answer; a checkpoint's longer max_len is "
                      "lowered"),
    "--memory-budget-mb": ("memory_budget_mb", int, "estimated model working memory of the batches running at "
                           "once, both models together; an input larger than this runs alone"),
    "--max-buffered-mb": ("max_buffered_mb", int, "request bodies held by all connections at once; a body that "
                          "would pass it is refused with 503 and Retry-After before more is read"),
    "--input-budget-mb": ("input_budget_mb", int, "estimated memory of the requests' inputs held at once (images "
                          "being decoded and decoded, strokes being parsed and parsed, articles), taken before the "
                          "work; a request that would pass it gets 503 and Retry-After"),
}
LIMIT_FLAGS = {field: flag for flag, (field, _, _) in LIMIT_OPTIONS.items()}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _flag_default(field: str, value):
    """A Limits field's default in the flag's unit (--max-upload-mb is in MiB)."""
    return value / (1 << 20) if field == "max_upload_bytes" else value


def add_limit_arguments(p) -> None:
    """The request-limit flags, their defaults read from :class:`~tellkit.server.limits.Limits`."""
    from tellkit.server.limits import Limits  # heavy

    defaults = Limits()
    for flag, (field, kind, text) in LIMIT_OPTIONS.items():
        value = _flag_default(field, getattr(defaults, field))
        p.add_argument(flag, type=kind, default=value,
                       help=f"{text} (default {value:g})" if kind is float else f"{text} (default {value:,})")


def _task(name: str, where: str) -> str:
    """A served task's key (a former name such as ``math`` is read with a deprecation message)."""
    from tellkit.recipes import task_key  # heavy
    from tellkit.server.backends import SERVED_TASKS  # heavy

    key = task_key(name, where)
    if key not in SERVED_TASKS:
        raise TellkitError(f"{where}: expected {' or '.join(SERVED_TASKS)}, got '{name}'")
    return key


def parse_checkpoints(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not path:
            raise TellkitError(f"--model expects caption=DIR or recognize=DIR, got '{v}'")
        name = _task(name, "--model")
        if name in out:
            raise TellkitError(f"--model {name}= given twice")
        out[name] = path
    return out


def plan(args) -> dict[str, str | None]:
    """Which model each served task gets: a checkpoint folder, or None for a tiny random model
    (``--untrained``, only for tasks without ``--model``). Without ``--untrained`` a task with
    no ``--model`` gets the packaged default, which must be installed."""
    from tellkit.recipes import PACKAGED_DEFAULTS, packaged_default  # heavy
    from tellkit.server.backends import SERVED_TASKS  # heavy

    names = [x.strip() for x in args.models.split(",") if x.strip()]
    if not names:
        raise TellkitError(f"--models: expected {', '.join(SERVED_TASKS)} or both, got '{args.models}'")
    asked = {_task(x, "--models") for x in names}
    wanted = [m for m in SERVED_TASKS if m in asked]
    ckpts = parse_checkpoints(args.checkpoint)
    extra = set(ckpts) - set(wanted)
    if extra:
        raise TellkitError(f"--model {', '.join(sorted(extra))}=... given but not in --models {args.models}")
    for name, path in ckpts.items():
        if not Path(path).is_dir():
            raise TellkitError(f"--model {name}={path}: not a directory")
    out: dict[str, str | None] = {}
    for name in wanted:
        if name in ckpts:
            out[name] = ckpts[name]
        elif args.untrained:
            out[name] = None
        elif packaged_default(name) is not None:
            out[name] = str(packaged_default(name))
        else:
            raise TellkitError(f"no {name} checkpoint: the packaged default {PACKAGED_DEFAULTS[name]} is not "
                               f"installed; pass --model {name}=DIR, leave {name} out of --models, or add --untrained")
    return out


def load_backends(args) -> dict[str, object]:
    """``{task: pipeline}``: each requested model loaded once, before the server starts (a
    failure stops start-up)."""
    from tellkit.server.backends import load_served  # heavy

    encoders = encoder_overrides(getattr(args, "encoder", []))
    chosen, runtime = plan(args), getattr(args, "runtime", None)
    if runtime == "onnx" and None in chosen.values():
        random = ", ".join(task for task, path in chosen.items() if path is None)
        raise TellkitError(f"--runtime onnx runs a checkpoint's exported graphs; the --untrained {random} model has "
                           f"none: pass --model {random.split(',')[0]}=DIR or leave out --runtime onnx")
    return load_served(chosen, device=args.device, dtype=getattr(args, "dtype", None), runtime=runtime,
                       options={"caption": {"encoders": encoders}} if encoders else None)


def serve_limits(args):
    """The server's :class:`~tellkit.server.limits.Limits` from the flags; a value out of range
    (or not finite) is a one-line error naming the flag."""
    from tellkit.server.limits import Limits  # heavy

    mb = args.max_upload_mb
    if not (math.isfinite(mb) and 0 < mb <= 1024):
        raise TellkitError(f"--max-upload-mb must be a number of MiB above 0 and at most 1024, got {mb:g}")
    values = {field: getattr(args, _dest(flag)) for flag, (field, _, _) in LIMIT_OPTIONS.items()}
    values["max_upload_bytes"] = max(1, int(mb * 1024 * 1024))
    try:
        return Limits(**values)
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise TellkitError(f"{LIMIT_FLAGS.get(field, field)} {rest}") from None


def check_run_settings(args) -> None:
    """The port, the batching and thread settings and the device, before anything is loaded."""
    if not 0 <= args.port <= 65535:
        raise TellkitError(f"--port {args.port}: out of range")
    if not 1 <= args.max_batch <= 1024:
        raise TellkitError(f"--max-batch must be from 1 to 1024, got {args.max_batch}")
    if not (math.isfinite(args.max_wait_ms) and 0 <= args.max_wait_ms <= 10_000):
        raise TellkitError(f"--max-wait-ms must be a number of milliseconds from 0 to 10000, got {args.max_wait_ms:g}")
    if not 0 <= args.threads <= 1024:
        raise TellkitError(f"--threads must be 0 (torch's choice) or up to 1024 threads, got {args.threads}")
    from tellkit.utils.precision import resolve_device  # heavy

    resolve_device(args.device)  # an unknown device, or a GPU this machine does not have: one line


def run(args) -> int:
    from tellkit.utils.optional import require  # heavy

    require("fastapi", "server", "tellkit serve")
    require("uvicorn", "server", "tellkit serve")
    from tellkit.server.app import check_static, create_app  # heavy
    from tellkit.server.runner import bind, serve  # heavy

    limits = serve_limits(args)
    check_run_settings(args)
    if not args.api_only:
        check_static()  # fail before loading models, not after
    sock = bind(args.host, args.port)  # a port in use: one line, before the models load
    limit_arenas(2)  # fewer malloc arenas for the server's threads: less memory kept after a burst
    if args.threads:
        import torch  # heavy

        torch.set_num_threads(args.threads)
    models = load_backends(args)
    for name, b in models.items():
        if b is not None:
            info = b.info
            state = "trained" if info.get("trained") else "UNTRAINED (outputs are noise)"
            print(f"tellkit serve: {name}: {info.get('name')} {state}, checkpoint {info.get('checkpoint') or '-'}, "
                  f"{info.get('dtype', 'float32')}, runtime {info.get('runtime', 'torch')}", file=sys.stderr)
            if info.get("dtype_note"):
                print(f"tellkit serve: {name}: note: {info['dtype_note']}", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"tellkit serve: WARNING: binding {args.host}: reachable from other machines", file=sys.stderr)
    app = create_app(models, limits, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                     serve_page=not args.api_only)
    for name, b in models.items():
        low = (b.info.get("served_with") or {}).get("lowered_from") if b is not None else None
        if low:
            now = b.info["served_with"]
            print(f"tellkit serve: {name}: the checkpoint's beam_size {low['beam_size']} / max_len {low['max_len']} "
                  f"served as {now['beam_size']} / {now['max_len']} (--max-beam-size, --max-gen-len)", file=sys.stderr)
    print(f"tellkit serve: http://{args.host}:{args.port}/", file=sys.stderr)
    serve(app, args.host, args.port, limits, log_level=args.log_level, sock=sock)
    return 0
