"""Settings that would make one request unbounded work, and the HTTP framing and input checks of
issue 28, through the real ``tellkit`` command (a child process) or a real server socket: a
checkpoint's or a flag's beam / max_len over the caps is refused in one line; the server
lowers a checkpoint's search to its serving caps, names models without host paths, refuses
ambiguous framing, over-long boundaries, deep JSON and huge coordinates."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tellkit.recipes import MAX_BEAM_SIZE, MAX_GENERATION_LEN
from tellkit.tasks.captioning import CaptionGeneration
from tellkit.tasks.recognition import RecognitionGeneration
from tellkit.tasks.summarization import SummaryGeneration

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import one_line_error as _one_line_error  # noqa: E402
from cli_checks import stop, wait_for_health  # noqa: E402

TELLKIT = [sys.executable, "-m", "tellkit"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def tellkit(*args, timeout=120):
    return subprocess.run([*TELLKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)


def one_line_error(res, *needles):
    return _one_line_error(res, *needles, stdout_empty=True)


@pytest.fixture(scope="module")
def bttr_ckpt(tmp_path_factory):
    """A tiny random BTTR checkpoint (config.json with a recipe's data / eval sections)."""
    from tellkit.registry import create_model

    model = create_model("bttr/tiny")
    return model.save_pretrained(tmp_path_factory.mktemp("bttr") / "tiny",
                                 extra={"data": {"layout": "inkml"}, "eval": {"beam_size": 2, "max_len": 12}})


def hostile_copy(src: Path, dst: Path, **eval_settings) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    meta = json.loads((dst / "config.json").read_text())
    meta["eval"] = {**meta.get("eval", {}), **eval_settings}
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


# --- the caps, every family ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [CaptionGeneration, RecognitionGeneration, SummaryGeneration])
@pytest.mark.parametrize("field, value", [("beam_size", 100_000), ("beam_size", 1e8), ("max_len", 10**8),
                                          ("beam_size", MAX_BEAM_SIZE + 1), ("max_len", MAX_GENERATION_LEN + 1),
                                          ("beam_size", 2.5), ("beam_size", "wide")])
def test_every_family_refuses_generation_over_the_caps(cls, field, value):
    from tellkit.errors import TellkitError

    with pytest.raises(TellkitError) as err:
        cls.from_section({field: value})
    assert field in str(err.value) and "\n" not in str(err.value)
    cls.from_section({"beam_size": MAX_BEAM_SIZE, "max_len": MAX_GENERATION_LEN})  # the caps themselves pass


def test_a_model_with_a_position_table_caps_max_len():
    from tellkit.errors import TellkitError

    with pytest.raises(TellkitError, match="over the 600 positions"):
        SummaryGeneration(max_len=700).check_positions(600)


@pytest.mark.parametrize("settings, needle", [({"beam_size": 100_000}, "beam_size 100,000 is over the limit"),
                                              ({"beam_size": 1e8}, "beam_size 100,000,000 is over"),
                                              ({"max_len": 10**8}, "max_len 100,000,000 is over")])
def test_recognize_refuses_a_checkpoint_with_hostile_settings(bttr_ckpt, tmp_path, settings, needle):
    from tellkit.pipelines.recognition import SAMPLE_PATH

    bad = hostile_copy(bttr_ckpt, tmp_path / "bad", **settings)
    one_line_error(tellkit("recognize", SAMPLE_PATH, "--model", bad), needle)


@pytest.mark.parametrize("flag, value, needle", [("--beam-size", 100_000_000, "beam_size 100,000,000 is over"),
                                                 ("--max-len", 10**9, "max_len 1,000,000,000 is over"),
                                                 ("--batch-size", 0, "--batch-size: must be at least 1")])
def test_recognize_refuses_hostile_flags(bttr_ckpt, flag, value, needle):
    from tellkit.pipelines.recognition import SAMPLE_PATH

    one_line_error(tellkit("recognize", SAMPLE_PATH, "--model", bttr_ckpt, flag, value), needle)


# --- the server, a real process -----------------------------------------------------------------
def start_server(*args, timeout=120):
    from tellkit.server.runner import free_port

    port = free_port()
    proc = subprocess.Popen([*TELLKIT, "serve", "--api-only", "--port", str(port), "--log-level", "warning",
                             *map(str, args)], stderr=subprocess.PIPE, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, timeout, pause=0.3)
    except OSError:
        proc.kill()
        raise
    return proc, url, port


@pytest.fixture(scope="module")
def hostile_server(bttr_ckpt, tmp_path_factory):
    """``tellkit serve`` with a checkpoint whose stored search is as wide and long as the caps allow."""
    bad = hostile_copy(bttr_ckpt, tmp_path_factory.mktemp("srv") / "wide",
                       beam_size=MAX_BEAM_SIZE, max_len=MAX_GENERATION_LEN)
    # the task's former name, still read (with a deprecation line)
    proc, url, port = start_server("--models", "math", "--checkpoint", f"math={bad}")
    try:
        yield proc, url, port, bad
    finally:
        stop(proc)


def test_the_server_lowers_a_hostile_search_and_hides_host_paths(hostile_server):
    from tellkit.pipelines.recognition import SAMPLE_PATH
    from tellkit.server.runner import post

    _, url, _, bad = hostile_server
    raw = urllib.request.urlopen(url + "/health", timeout=10).read().decode()
    health = json.loads(raw)
    math = health["models"]["recognize"]
    assert math["served_with"]["beam_size"] == 16 and math["served_with"]["max_len"] == 256
    assert math["served_with"]["lowered_from"] == {"beam_size": MAX_BEAM_SIZE, "max_len": MAX_GENERATION_LEN}
    assert math["checkpoint"] == f"{bad.parent.name}/{bad.name}"
    assert str(bad.parent) not in raw and "/tmp" not in raw
    status, body = post(url + "/api/recognize", files={"image": ("x.png", SAMPLE_PATH.read_bytes(), "image/png")})
    assert status == 200, body
    assert str(bad.parent) not in json.dumps(body) and body["model"]["checkpoint"] == math["checkpoint"]


def test_a_packaged_default_is_named_not_located():
    from tellkit.server.backends import checkpoint_name

    assert checkpoint_name(Path("/a/b/c/run/best")) == "run/best"


def raw_exchange(port, payload: bytes, wait_s=5.0) -> bytes:
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(payload)
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait_s:
            try:
                got = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not got:
                break
            out += got
    return out


def test_content_length_with_transfer_encoding_is_400_and_the_smuggled_request_unanswered(hostile_server):
    _, _, port, _ = hostile_server
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    first = (b"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
             b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    raw = raw_exchange(port, first + smuggled)
    assert raw.startswith(b"HTTP/1.1 400"), raw[:300]
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # the second request is never answered
    body = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert body["error"] == "bad_framing" and "Transfer-Encoding" in body["detail"]


def test_an_over_long_boundary_is_400(hostile_server):
    _, _, port, _ = hostile_server
    boundary = "b" * 300
    form = f"--{boundary}\r\nContent-Disposition: form-data; name=\"strokes\"\r\n\r\n[[[1,2]]]\r\n--{boundary}--\r\n"
    head = (f"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(form)}\r\n\r\n")
    raw = raw_exchange(port, (head + form).encode())
    assert raw.startswith(b"HTTP/1.1 400"), raw[:300]
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"] == "bad_request"


@pytest.mark.parametrize("strokes, needle", [("[" * 1500 + "]" * 1500, "nested too deeply"),
                                             ("[[[1e308, 1], [-1e308, 5]]]", "finite numbers of at most"),
                                             ("[[[1, 2], [NaN, 3]]]", "finite numbers"),
                                             ("[[[1, 2], [Infinity, 3]]]", "finite numbers")])
def test_hostile_strokes_are_422(hostile_server, strokes, needle):
    from tellkit.server.runner import post

    _, url, _, _ = hostile_server
    status, body = post(url + "/api/recognize", fields={"strokes": strokes})
    assert (status, body["error"]) == (422, "bad_input"), body
    assert needle in body["detail"]


def test_a_port_in_use_is_one_line(hostile_server):
    _, _, port, _ = hostile_server
    one_line_error(tellkit("serve", "--api-only", "--untrained", "--models", "recognize", "--port", port),
                   f"port {port}", "already in use")


@pytest.mark.parametrize("text, needle", [("1 2, nan 3", "NaN or infinite"), ("1 2, inf 3", "NaN or infinite"),
                                          ("1 2, 1e999 3", "NaN or infinite"), ("1 2, 1e300 3", "magnitude")])
def test_inkml_with_non_finite_coordinates_is_refused(bttr_ckpt, tmp_path, text, needle):
    f = tmp_path / "bad.inkml"
    f.write_text(f'<ink xmlns="http://www.w3.org/2003/InkML"><trace id="0">{text}</trace></ink>')
    one_line_error(tellkit("recognize", f, "--model", bttr_ckpt), "bad coordinates", needle)


def test_a_caption_monitor_that_eval_metrics_leaves_out_is_refused_before_training(tmp_path, capsys):
    from tellkit.cli import main
    from tellkit.errors import TellkitError
    from tellkit.tasks.captioning import CaptioningTask

    def task(metrics, monitor):
        return CaptioningTask({"task": "caption", "model": {"name": "transform_and_tell"},
                               "eval": {"metrics": metrics, "monitor": monitor}})

    with pytest.raises(TellkitError, match="eval.monitor 'cider'.*'cider' metric"):
        task(["bleu"], "cider").check_training()
    task(["bleu", "cider"], "cider").check_training()  # computed: accepted
    task(["bleu"], "loss").check_training()
    task(["bleu"], "cider")  # evaluation alone may score fewer metrics than the monitor needs
    out = tmp_path / "run"
    code = main(["train", "configs/tat/flickr8k_scst.yaml", "eval.metrics=[bleu]", "eval.monitor=cider",
                 "--out", str(out), "--no-progress"])
    assert code == 2 and "eval.monitor 'cider'" in capsys.readouterr().err
    assert not out.exists()
