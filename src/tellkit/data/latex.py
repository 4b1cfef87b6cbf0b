"""LaTeX for handwritten-math recognition: tokenizer, normaliser and the 110-symbol vocabulary.

Raw CROHME ground truth is written by many hands (``\\frac 1 2``, ``x^2``, ``\\lt``,
``\\left(``, ``\\mbox{a}``, ``{x^{2}}``, ``l o g``...). BTTR and the WAP line of work train and
score on a space-separated 110-symbol form in which

* every script / fraction / root argument is braced (``x ^ { 2 }``, ``\\frac { 1 } { 2 }``),
  an optional root index is bracketed (``\\sqrt [ 3 ] { x }``),
* braces that are not an argument are dropped (``{x^{2}}`` -> ``x ^ { 2 }``),
* sizing commands disappear (``\\left``, ``\\right``, ``\\Big``, ``\\Bigg``, spacing),
  ``\\mbox{...}`` is unwrapped, numbers are split into digits,
* synonyms are merged: ``\\lt`` -> ``<``, ``\\gt`` -> ``>``, ``\\to`` -> ``\\rightarrow``,
  ``\\dots`` -> ``\\ldots``, spelled-out ``l o g`` / ``s i n`` ... -> ``\\log`` / ``\\sin``.

Beyond CROHME's symbols (the labels of MathWriting and HME100K), accents and fonts keep their
argument braced (``\\hat { a b }``, ``\\mathbb { R }``), an environment's name is part of one
token (``\\begin{matrix}``), and ``\\\\`` is kept as a row break inside an environment.

:func:`normalize` maps raw LaTeX to that form (a token list); :class:`Vocab` maps tokens to ids
(``<pad>`` = 0, ``<sos>`` = 1, ``<eos>`` = 2, then the 110 symbols in sorted order).
The parser is our own: a small recursive descent over groups and argument-taking commands.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tellkit.errors import TellkitError

# The 110 symbols of the CROHME caption files used by WAP / DenseWAP / BTTR.
SYMBOLS: tuple[str, ...] = tuple(sorted("""
! ' ( ) + , - . / 0 1 2 3 4 5 6 7 8 9 < = > A B C E F G H I L M N P R S T V X Y [ ] \\{ \\}
\\Delta \\alpha \\beta \\cdot \\cdots \\cos \\div \\exists \\forall \\frac \\gamma \\geq \\in
\\infty \\int \\lambda \\ldots \\leq \\lim \\limits \\log \\mu \\neq \\phi \\pi \\pm \\prime
\\rightarrow \\sigma \\sin \\sqrt \\sum \\tan \\theta \\times ^ _ a b c d e f g h i j k l m n o
p q r s t u v w x y z { | }
""".split()))
assert len(SYMBOLS) == 110, len(SYMBOLS)

PAD, SOS, EOS = "<pad>", "<sos>", "<eos>"
PAD_ID, SOS_ID, EOS_ID = 0, 1, 2  # their ids: the first entries of every Vocab

# raw tokens: a command (\name), an escaped symbol (\{ \, \\ ...), or one non-space character
_TOKEN_RE = re.compile(r"\\[A-Za-z]+|\\.|\S", re.S)

SYNONYMS = {
    "\\lt": "<", "\\gt": ">", "\\to": "\\rightarrow", "\\dots": "\\ldots", "\\le": "\\leq",
    "\\ge": "\\geq", "\\ne": "\\neq", "\\rightarrow": "\\rightarrow", "\\lbrace": "\\{",
    "\\rbrace": "\\}", "\\lbrack": "[", "\\rbrack": "]", "\\vert": "|", "\\mid": "|",
    "\\ast": "*", "\\colon": ":", "\\dotsc": "\\ldots", "\\cdotp": "\\cdot", "\\lvert": "|",
    "\\rvert": "|",
}
# produce nothing (sizing, spacing, styling wrappers handled separately)
DROPPED = {
    "\\left", "\\right", "\\big", "\\Big", "\\bigg", "\\Bigg", "\\bigl", "\\bigr", "\\Bigl",
    "\\Bigr", "\\,", "\\;", "\\!", "\\:", "\\ ", "\\quad", "\\qquad", "\\displaystyle",
    "\\\\", "\\nonumber", "\\limits_unused",
}
# wrappers whose single argument is spliced in without braces
UNWRAP = {"\\mbox", "\\mathrm", "\\text", "\\textrm", "\\mathit", "\\mathbf", "\\rm", "\\operatorname"}
# commands of one argument outside CROHME's symbols (accents, fonts: MathWriting, HME100K): the
# argument keeps its braces, ``\hat{ab}`` -> ``\hat { a b }``
ARG1 = {
    "\\hat", "\\bar", "\\overline", "\\underline", "\\vec", "\\dot", "\\ddot", "\\tilde", "\\widehat",
    "\\widetilde", "\\check", "\\breve", "\\acute", "\\grave", "\\mathring", "\\mathbb", "\\mathcal",
    "\\mathfrak", "\\mathscr", "\\boldsymbol", "\\overrightarrow", "\\overleftarrow", "\\underbrace",
    "\\overbrace",
}
# spelled-out function names written letter by letter
FUNCTION_WORDS = {"log": "\\log", "sin": "\\sin", "cos": "\\cos", "tan": "\\tan", "lim": "\\lim"}


_NUMBER_RE = re.compile(r"^\s*\d+(\.\d*)?\s*$")


def _known_commands() -> set[str]:
    return {s for s in SYMBOLS if s.startswith("\\")} | set(SYNONYMS) | DROPPED | UNWRAP


def lex(text: str) -> list[str]:
    """Split raw LaTeX into raw tokens (no normalisation).

    A command glued to following letters (``\\ltN`` for ``\\lt N``) is split when it is not
    a known command but starts with one.
    """
    out: list[str] = []
    known = _known_commands()
    for t in _TOKEN_RE.findall(text):
        if len(t) > 2 and t[0] == "\\" and t not in known:
            head = max((k for k in known if t.startswith(k) and k[1:].isalpha()), key=len, default=None)
            if head is not None:
                out.append(head)
                out.extend(t[len(head):])
                continue
        out.append(t)
    return out


def _canonical_number(text: str) -> str:
    """A label that is only a number is written as its value: ``05`` -> ``5``, ``6.0`` -> ``6``."""
    whole, _, frac = text.strip().partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    return whole + ("." + frac if frac else "")


@dataclass
class _Group:
    items: list = field(default_factory=list)


class _Parser:
    def __init__(self, toks: list[str]):
        self.toks, self.i = toks, 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        t = self.toks[self.i]
        self.i += 1
        return t

    def sequence(self, closer: str | None) -> list:
        out: list = []
        while True:
            t = self.peek()
            if t is None:  # an unclosed '{' is closed at the end
                return out
            if t == closer and closer is not None:
                self.take()
                return out
            if t == "}":  # a stray closing brace (seen in CROHME truth): ignore it
                self.take()
                continue
            out.append(self.atom())

    def atom(self):
        t = self.take()
        if t == "{":
            return _Group(self.sequence("}"))
        return t


def _tree(text: str) -> list:
    return _Parser(lex(text)).sequence(None)


class _Emitter:
    """Walks the parse tree and writes normalised tokens to ``self.out``."""

    def __init__(self):
        self.out: list[str] = []
        self.env = 0  # depth of \begin{...} environments, inside which \\ separates rows

    def seq(self, items: list) -> None:
        i = 0
        while i < len(items):
            i = self.unit(items, i)

    def unit(self, items: list, i: int) -> int:
        """Emit the unit starting at ``items[i]`` (a command with its arguments); return the next index."""
        x = items[i]
        i += 1
        if isinstance(x, _Group):  # a bare group: its braces carry no meaning here
            self.seq(x.items)
            return i
        t = SYNONYMS.get(x, x)
        if t in ("\\begin", "\\end") and i < len(items) and isinstance(items[i], _Group) and items[i].items \
                and all(isinstance(c, str) and (c.isalpha() or c == "*") for c in items[i].items):
            self.out.append(t + "{" + "".join(items[i].items) + "}")  # one token: \begin{matrix}
            self.env = max(0, self.env + (1 if t == "\\begin" else -1))
            return i + 1
        if t == "\\\\" and self.env:  # a row break inside an environment (matrices, cases)
            self.out.append(t)
            return i
        if t in ARG1:
            self.out.append(t)
            return self.argument(items, i, t)
        if t in DROPPED:
            if t in ("\\left", "\\right") and i < len(items) and items[i] == ".":
                i += 1  # \left. / \right. : an invisible delimiter
            return i
        if t in UNWRAP:
            return self.unit(items, i) if i < len(items) else i
        if t not in ("^", "_", "\\frac", "\\sqrt"):
            self.out.append(t)
            return i
        if t == "\\sqrt":
            return self.sqrt(items, i)
        self.out.append(t)
        for _ in range(2 if t == "\\frac" else 1):
            i = self.argument(items, i, t)
        return i

    def argument(self, items: list, i: int, owner: str) -> int:
        while i < len(items) and not isinstance(items[i], _Group) and SYNONYMS.get(items[i], items[i]) in DROPPED:
            i += 1
        self.out.append("{")
        if i >= len(items):  # a missing argument (broken truth) becomes an empty one
            self.out.append("}")
            return i
        i = self.unit(items, i)  # a group is flattened inside the braces
        self.out.append("}")
        return i

    def sqrt(self, items: list, i: int) -> int:
        """``\\sqrt[n]{x}``, ``\\sqrt x``, and the converter form ``\\sqrt {x} ABOVE {n}``."""
        index: list[str] | None = None
        if i < len(items) and items[i] == "[" and "]" in items[i:]:
            j = items.index("]", i)
            sub = _Emitter()
            sub.seq(items[i + 1 : j])
            index, i = sub.out, j + 1
        body = _Emitter()
        i = body.argument(items, i, "\\sqrt")
        if index is None and items[i : i + 5] == list("ABOVE") and i + 5 < len(items):
            sub = _Emitter()
            sub.seq([items[i + 5]])
            index, i = sub.out, i + 6
        self.out.append("\\sqrt")
        if index is not None:
            self.out += ["[", *index, "]"]
        self.out += body.out
        return i


def _merge_function_words(tokens: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(tokens):
        for word, cmd in FUNCTION_WORDS.items():
            n = len(word)
            if tokens[i : i + n] == list(word):
                prev = tokens[i - 1] if i else ""
                nxt = tokens[i + n] if i + n < len(tokens) else ""
                # only a whole word followed by its argument: not inside a longer run of letters
                # ("blog"), and not a script's whole content (``a_{tan}`` is a subscript "tan")
                if not (len(prev) == 1 and prev.isalpha()) and nxt not in ("", "}"):
                    out.append(cmd)
                    i += n
                    break
        else:
            out.append(tokens[i])
            i += 1
    return out


def _shown(text: str, limit: int = 120) -> str:
    """``text`` quoted for a one-line message, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text):,} characters)"


def normalize(text: str, strict: bool = False) -> list[str]:
    """Raw LaTeX -> list of normalised tokens. ``strict``: raise on a symbol outside the 110."""
    if _NUMBER_RE.match(text):  # the reference captions store bare numbers by value
        text = _canonical_number(text)
    try:
        em = _Emitter()
        em.seq(_tree(text))
    except ValueError as exc:
        raise TellkitError(f"cannot parse LaTeX {_shown(text)}: {exc}") from exc
    except RecursionError:
        raise TellkitError(f"cannot parse LaTeX {_shown(text)}: nested too deeply") from None
    toks = _merge_function_words(em.out)
    if strict:
        bad = [t for t in toks if t not in _SYMBOL_SET]
        if bad:
            raise TellkitError(f"LaTeX {_shown(text)}: symbol(s) outside the vocabulary: {' '.join(sorted(set(bad)))}")
    return toks


def normalize_string(text: str) -> str:
    return " ".join(normalize(text))


_SYMBOL_SET = frozenset(SYMBOLS)


def grow(base: Sequence[str], labels: Iterable[Sequence[str]]) -> tuple[list[str], list[str]]:
    """``base`` followed by the symbols of ``labels`` that it lacks (sorted), and those new
    symbols: the ids of ``base`` stay what they were, so a model's rows for them are kept."""
    known = set(base)
    new = sorted({t for toks in labels for t in toks} - known - {PAD, SOS, EOS})
    return [*base, *new], new


def check_symbols(symbols: object, where: str = "data.symbols") -> list[str]:
    """A vocabulary's symbols as a recipe or a checkpoint writes them: distinct non-empty
    strings without spaces, none of ``<pad> <sos> <eos>`` (those come first in every Vocab)."""
    if not isinstance(symbols, (list, tuple)) or not all(isinstance(s, str) and s and not s.split()[1:]
                                                         and s == s.strip() for s in symbols):
        raise TellkitError(f"{where}: expected a list of symbols (strings without spaces), got {symbols!r:.80}")
    bad = [s for s in symbols if s in (PAD, SOS, EOS)]
    if bad or len(set(symbols)) != len(symbols):
        raise TellkitError(f"{where}: " + (f"{bad[0]} is not a symbol (it comes first in every vocabulary)" if bad
                                           else "a symbol is listed twice"))
    return list(symbols)


class Vocab:
    """Token <-> id. Ids 0..2 are ``<pad>``, ``<sos>``, ``<eos>``; then the symbols (by default
    CROHME's 110; a model trained on other data stores its own, see :func:`grow`)."""

    def __init__(self, symbols: Sequence[str] = SYMBOLS):
        self.itos = [PAD, SOS, EOS] + list(symbols)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("duplicate symbols in vocabulary")
        self.pad, self.sos, self.eos = 0, 1, 2

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        ids = []
        for t in tokens:
            if t not in self.stoi:
                raise TellkitError(f"token {t!r} is not in the vocabulary")
            ids.append(self.stoi[t])
        return ids

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.itos[i] for i in ids if i > 2]

    @property
    def symbols(self) -> list[str]:
        """The symbols after ``<pad> <sos> <eos>``."""
        return self.itos[3:]

