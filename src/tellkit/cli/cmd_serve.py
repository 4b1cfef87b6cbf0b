"""`tellkit serve [--host 127.0.0.1] [--port 8000] [--model caption=DIR] [--model recognize=DIR] [--dtype bf16]`:
the HTTP JSON API and the demo page (see docs/server.md)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from tellkit.cli import add_dtype_argument, add_encoder_argument, encoder_overrides
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
    p.add_argument("--max-batch", type=int, default=8, help="requests grouped into one forward pass (default 8)")
    p.add_argument("--max-wait-ms", type=float, default=10.0,
                   help="how long the worker waits to fill a batch (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds (default 60)")
    p.add_argument("--max-upload-mb", type=float, default=8.0, help="request body limit in MiB (default 8)")
    p.add_argument("--max-image-pixels", type=int, default=16_000_000, help="image width x height limit (default 16M)")
    p.add_argument("--max-article-chars", type=int, default=20_000, help="article length limit (default 20000)")
    p.add_argument("--max-decoding", type=int, default=2,
                   help="images decoded at once; each holds up to ~100 MiB at the default pixel limit (default 2)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's line and headers to arrive (default 10)")
    p.add_argument("--body-idle-timeout", type=float, default=15.0,
                   help="longest silence in seconds while a request body arrives (default 15)")
    p.add_argument("--body-timeout", type=float, default=120.0,
                   help="seconds for a whole request body to arrive (default 120)")
    p.add_argument("--max-beam-size", type=int, default=16,
                   help="widest beam served; a checkpoint's wider one is lowered to it (default 16)")
    p.add_argument("--max-gen-len", type=int, default=256,
                   help="most tokens generated per answer; a checkpoint's longer max_len is lowered (default 256)")
    p.add_argument("--memory-budget-mb", type=int, default=384,
                   help="estimated model working memory of the batches running at once, both models together; "
                   "an input larger than this runs alone (default 384)")
    p.add_argument("--max-buffered-mb", type=int, default=128,
                   help="request bodies held by all connections at once; a body that would pass it is refused "
                   "with 503 and Retry-After before more is read (default 128)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--api-only", action="store_true", help="serve the API without the page")
    add_encoder_argument(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


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
    return load_served(plan(args), device=args.device, dtype=getattr(args, "dtype", None),
                       options={"caption": {"encoders": encoders}} if encoders else None)


LIMIT_FLAGS = {"max_upload_bytes": "--max-upload-mb", "max_image_pixels": "--max-image-pixels",
               "max_article_chars": "--max-article-chars", "request_timeout_s": "--timeout",
               "max_decoding": "--max-decoding", "header_timeout_s": "--header-timeout",
               "body_idle_timeout_s": "--body-idle-timeout", "body_timeout_s": "--body-timeout",
               "max_beam_size": "--max-beam-size", "max_gen_len": "--max-gen-len",
               "memory_budget_mb": "--memory-budget-mb", "max_buffered_mb": "--max-buffered-mb"}


def serve_limits(args):
    """The server's :class:`~tellkit.server.limits.Limits` from the flags; a value out of range
    (or not finite) is a one-line error naming the flag."""
    from tellkit.server.limits import Limits  # heavy

    mb = args.max_upload_mb
    if not (math.isfinite(mb) and 0 < mb <= 1024):
        raise TellkitError(f"--max-upload-mb must be a number of MiB above 0 and at most 1024, got {mb:g}")
    try:
        return Limits(max_upload_bytes=max(1, int(mb * 1024 * 1024)), max_image_pixels=args.max_image_pixels,
                      max_article_chars=args.max_article_chars, request_timeout_s=args.timeout,
                      max_decoding=args.max_decoding, header_timeout_s=args.header_timeout,
                      body_idle_timeout_s=args.body_idle_timeout, body_timeout_s=args.body_timeout,
                      max_beam_size=args.max_beam_size, max_gen_len=args.max_gen_len,
                      memory_budget_mb=args.memory_budget_mb, max_buffered_mb=args.max_buffered_mb)
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
                  f"{info.get('dtype', 'float32')}", file=sys.stderr)
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
