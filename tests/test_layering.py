"""The import rules of ``src/tellkit``, checked on the source (every import, at any depth,
deferred ones included): each module imports only from its own layer or the layers below it
(:data:`LAYERS`, the table the README's "Map of the code" shows), no file-level import cycle,
an import inside a function only for an optional or heavy dependency with that reason beside it,
and short functions in ``server/`` and ``convert/``."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tellkit"

# Lowest first. A name is a top-level module or folder of src/tellkit; "" is the package's own
# __init__.py (the public API). A module may import from its own layer and the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version"),
    ("utils", "config"),
    ("recipes",),
    ("registry",),
    ("checkpoint",),
    ("layers", "decoding", "metrics", "encoders"),
    ("data",),
    ("models",),
    ("convert", "training"),
    ("export",),
    ("runtime",),
    ("tasks",),
    ("pipelines", "workflows", ""),
    ("server",),
    ("bench",),
    ("cli", "__main__"),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# the one word that says why an import waits inside a function
DEFERRAL_REASONS = ("optional", "heavy")
MAX_FUNCTION_LINES = {"server": 60, "convert": 60}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def group(module: str) -> str:
    """The layer-table name of a module: its top-level module or folder under tellkit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def resolve(name: str) -> str:
    """The module file an imported name lives in (``tellkit.a.b.func`` -> ``tellkit.a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path):
    """(imported module, line, deferred) for every tellkit import in a file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def visit(node, deferred):
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child, deferred) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = module_name(path).split(".")
                    if path.name != "__init__.py":
                        base = base[:-1]
                    base = base[: len(base) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.extend((f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod, child, deferred)
                           for a in child.names)
            visit(child, inner)

    visit(tree, False)
    return out


def internal_edges():
    for mod, path in MODULES.items():
        for name, node, deferred in imports(path):
            if name == "tellkit" or name.startswith("tellkit."):
                yield mod, resolve(name), node, deferred


def test_every_module_has_a_layer():
    missing = sorted({group(m) for m in MODULES} - set(LAYER))
    assert not missing, f"add these to LAYERS (and to the README's map): {missing}"


def test_no_module_imports_from_a_layer_above_it():
    bad = [f"{MODULES[src].relative_to(SRC)}:{node.lineno} imports {dst} ({group(dst) or 'tellkit'} is above "
           f"{group(src) or 'tellkit'})"
           for src, dst, node, _ in internal_edges() if LAYER[group(dst)] > LAYER[group(src)]]
    assert not bad, "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _, _ in internal_edges():
        if dst != src:
            graph[src].add(dst)
    return graph


def test_the_file_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def deferred_imports():
    for path in MODULES.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        seen = set()
        for name, node, deferred in imports(path):
            if deferred and id(node) not in seen:
                seen.add(id(node))
                yield path, name, node, lines[node.end_lineno - 1]


def test_internal_imports_are_not_deferred():
    """A tellkit import inside a function hides a cycle or a layering break; the commands
    (cli/cmd_*.py) and the package's public API alone import the library late, so that
    ``tellkit --help`` and ``import tellkit`` stay fast."""
    bad = [f"{path.relative_to(SRC)}:{node.lineno} {name}" for path, name, node, _ in deferred_imports()
           if name.startswith("tellkit") and not re.fullmatch(r"cli/cmd_\w+\.py|__init__\.py",
                                                              str(path.relative_to(SRC)))]
    assert not bad, "\n".join(bad)


def test_every_deferred_import_says_why():
    bad = [f"{path.relative_to(SRC)}:{node.lineno} {line.strip()}" for path, _, node, line in deferred_imports()
           if not re.search(r"#\s*({})\b".format("|".join(DEFERRAL_REASONS)), line)]
    assert not bad, f"a deferred import ends with '# <reason>' ({', '.join(DEFERRAL_REASONS)}):\n" + "\n".join(bad)


def test_static_word_vectors_do_not_reach_into_the_article_encoder():
    assert not [n for n, *_ in imports(SRC / "encoders" / "static_vectors.py") if n.startswith("tellkit.encoders.text")]


@pytest.mark.parametrize("folder", sorted(MAX_FUNCTION_LINES))
def test_functions_are_short(folder):
    limit = MAX_FUNCTION_LINES[folder]
    long = []
    for path in sorted((SRC / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {limit} lines:\n" + "\n".join(long)


def test_one_module_is_named_checkpoint():
    """Saving and loading models is ``tellkit.checkpoint``; nothing else takes a name like it
    (a run's training states are ``training.run_states``)."""
    named = sorted(m for m in MODULES if m.rsplit(".", 1)[-1].startswith("checkpoint"))
    assert named == ["tellkit.checkpoint"], named


def test_help_and_the_parser_do_not_import_torch():
    """``tellkit --help`` and building the parser stay free of torch (the commands import it in run())."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, contextlib, io\n"
            "from tellkit.cli import build_parser, main\n"
            "build_parser()\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
