"""The documentation's commands run as written.

Which commands run: a fenced code block of ``README.md`` or ``docs/*.md`` whose nearest line
above (blank lines aside) is the HTML comment ``<!-- docs-test -->`` is a *cheap* block, one that
runs in seconds on a CPU with the packaged models and no data set. Its commands are run as a
reader would type them: each command line of a ``bash`` block (comments dropped, ``\\``
continuations joined) through ``bash`` with the environment's ``tellkit`` console script first
on ``PATH``, a ``python`` block as one script, all from a temporary folder outside the checkout
(nothing is imported from the source tree there except through the installed package). A
command that exits non-zero fails the test with the file and line of the command.

The temporary folder holds the inputs the docs name for "your own files": ``photo.jpg`` (a
packaged demo photo inside the captioner's domain), ``photos/`` (two of them), ``formula.png``
(the packaged sample formula's rendering) and ``expression.inkml`` (a packaged sample formula
in pen strokes).

A cheap block may only hold commands from :data:`CHEAP` (reading one or two packaged samples,
counting parameters, printing help), so that the whole test stays well under a minute of CPU.
Every other ``tellkit`` command of the docs (training, evaluation on a data set, serving) is
checked without running it: its subcommand must exist and each option it spells must be one that
subcommand's ``--help`` lists.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "tellkit" / "assets"
MARKER = "<!-- docs-test -->"
SHELLS = ("bash", "sh", "shell", "console")
# the tellkit subcommands a cheap block may run (any subcommand with --help or --version)
CHEAP = ("recognize", "caption", "model-info")
# pages that must keep at least one cheap block, so that the rule cannot quietly lose its coverage
PAGES_WITH_CHEAP_BLOCKS = ("README.md", "docs/bttr.md", "docs/captioning.md", "docs/transform_and_tell.md",
                           "docs/vg_gplm.md", "docs/server.md")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence (1-based)
    lang: str
    text: str
    cheap: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each marked cheap when MARKER is the nearest
    non-blank line above its opening fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        above = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        out.append(Block(path, start + 1, m.group(2), "\n".join(body) + "\n", above == MARKER))
        i += 1
    return out


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block: ``\\`` continuations joined,
    blank lines and whole-line comments dropped (a trailing comment is left to the shell)."""
    out, pending, first = [], "", None
    for k, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if first is None:
            first = block.line + 1 + k
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((first, pending + line))
        pending, first = "", None
    if pending:
        out.append((first, pending))
    return out


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in code_blocks(p)]


def cheap_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.cheap]


# --- running the cheap blocks -------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder outside the checkout with the inputs the docs name."""
    d = tmp_path_factory.mktemp("docs-test")
    assert not d.resolve().is_relative_to(ROOT), "the docs must run outside the checkout"
    shutil.copy2(ASSETS / "demo_caption" / "dogs.jpg", d / "photo.jpg")
    (d / "photos").mkdir()
    for name in ("dogs.jpg", "mountain_path.jpg"):
        shutil.copy2(ASSETS / "demo_caption" / name, d / "photos" / name)
    shutil.copy2(ASSETS / "samples" / "bttr_x2_plus_1.png", d / "formula.png")
    shutil.copy2(ASSETS / "samples" / "bttr_frac_a_b.inkml", d / "expression.inkml")
    return d


def environment() -> dict[str, str]:
    """The reader's shell: the environment's ``tellkit`` first on PATH, the model hub offline,
    one thread, and no PYTHONPATH that could reach the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def _tail(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def test_the_tellkit_on_path_is_the_environments():
    found = shutil.which("tellkit", path=environment()["PATH"])
    assert found is not None, "no tellkit console script beside the interpreter: install the package"
    assert Path(found).parent == Path(sys.executable).parent, found


@pytest.mark.slow
@pytest.mark.parametrize("block", cheap_blocks(), ids=lambda b: b.where)
def test_cheap_block_runs_as_written(block, workdir):
    env = environment()
    if block.lang in SHELLS:
        for line, cmd in shell_commands(block):
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", cmd], cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, (
                f"{block.path.relative_to(ROOT)}:{line}: `{cmd}` exited {proc.returncode} from {workdir}\n"
                f"stdout:\n{_tail(proc.stdout)}\nstderr:\n{_tail(proc.stderr)}")
    elif block.lang == "python":
        script = workdir / f"block_{block.line}.py"
        script.write_text(block.text, encoding="utf-8")
        proc = subprocess.run([sys.executable, "-I", str(script)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (
            f"{block.where}: the Python block exited {proc.returncode} from {workdir}\n"
            f"stdout:\n{_tail(proc.stdout)}\nstderr:\n{_tail(proc.stderr)}")
    else:
        pytest.fail(f"{block.where}: a cheap block must be bash or python, not {block.lang or 'unlabelled'!r}")


def test_cheap_blocks_hold_only_cheap_commands():
    """The marker is kept for what runs in seconds: packaged samples, parameter counts, help."""
    wrong = []
    for block in cheap_blocks():
        if block.lang == "python":
            continue
        for line, cmd in shell_commands(block):
            words = shlex.split(cmd, comments=True)
            ok = bool(words) and words[0] == "tellkit" and (
                len(words) > 1 and (words[1] in CHEAP or "--help" in words or "-h" in words)
                or words[1:] == ["--version"])
            if not ok:
                wrong.append(f"{block.path.relative_to(ROOT)}:{line}: {cmd}")
    assert not wrong, "commands too costly (or not tellkit) for a docs-test block:\n" + "\n".join(wrong)


def test_each_page_keeps_a_cheap_block():
    have = {b.path.relative_to(ROOT).as_posix() for b in cheap_blocks()}
    missing = [p for p in PAGES_WITH_CHEAP_BLOCKS if p not in have]
    assert not missing, f"pages without a {MARKER} block: {missing}"


def test_marker_stands_before_a_code_block():
    """A marker followed by prose (a typo, a moved block) would silently test nothing."""
    lost = []
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for k, line in enumerate(lines):
            if line.strip() == MARKER:
                nxt = next((ln.strip() for ln in lines[k + 1:] if ln.strip()), "")
                if not nxt.startswith("```"):
                    lost.append(f"{path.relative_to(ROOT)}:{k + 1}")
    assert not lost, f"{MARKER} not followed by a code block: {lost}"


# --- every documented command exists with the options it spells -----------------------------------
_COMMAND = re.compile(r"(?<![\w./-])tellkit\s+([a-z][a-z-]*)")
_OPTION = re.compile(r"(?<![\w=./{-])(--?[A-Za-z][\w-]*)")


def documented_commands() -> list[tuple[str, str, str]]:
    """(where, subcommand, the text that follows it up to the end of the command) for every
    ``tellkit SUBCOMMAND`` of a code block and of an inline code span of the docs."""
    out = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        blocks = code_blocks(path)
        pieces = []  # (line, text)
        shells = [b for b in blocks if b.lang in SHELLS]
        for b in shells:
            pieces += [(ln, re.sub(r"\s#.*$", "", cmd)) for ln, cmd in shell_commands(b)]
        # the lines of other blocks (code, plain text such as the map of the code) count as prose
        fenced = {b.line + k for b in blocks if b.lang and b.lang not in SHELLS
                  for k in range(b.text.count("\n") + 2)} | {b.line + k for b in shells
                                                            for k in range(b.text.count("\n") + 2)}
        for k, line in enumerate(text.splitlines(), 1):
            if k not in fenced:
                pieces += [(k, span) for span in re.findall(r"`([^`]+)`", line)]
        for ln, piece in pieces:
            matches = list(_COMMAND.finditer(piece))
            for i, m in enumerate(matches):
                end = matches[i + 1].start() if i + 1 < len(matches) else len(piece)
                rest = re.split(r"&&|\|\||(?<!\\)\||;|>", piece[m.end():end])[0]
                out.append((f"{rel}:{ln}", m.group(1), rest))
    return out


def test_documented_commands_and_options_exist():
    from tellkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = sub.choices
    found = documented_commands()
    assert len(found) > 50, "too few tellkit commands found in the docs: is the extraction broken?"
    wrong = []
    for where, name, rest in found:
        if name not in commands:
            wrong.append(f"{where}: no command `tellkit {name}`")
            continue
        known = {s for a in commands[name]._actions for s in a.option_strings}
        for opt in _OPTION.findall(rest):
            if opt not in known:
                wrong.append(f"{where}: `tellkit {name}` has no option {opt}")
    assert not wrong, "\n".join(wrong)
