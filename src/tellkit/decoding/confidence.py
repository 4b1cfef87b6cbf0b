"""How sure an answer is: a number a person can read and a plain flag when it is low.

Every answer of ``recognize`` and ``caption`` carries

* ``confidence``: a number in [0, 1], the estimated chance that the answer is right, from the
  search's length-normalised log-probability (the result's ``score``) and the answer's length,
  mapped through a logistic curve fitted on the model's validation set
  (:class:`Calibration`, stored under ``confidence`` in the checkpoint's ``config.json``);
* ``unsure``: true when the confidence is below the stored threshold, and always for a runaway
  output (one token or a few repeated over and over, or the search's length limit reached),
  an empty answer, a search that found nothing, and an input whose features lie beyond the
  calibration's :class:`InputCheck` (the captioner's photos unlike its training photos)
  (:func:`assess`).

What "right" means is the model's: an exact match of the LaTeX for a formula reader, a caption
whose CIDEr-D against the image's references reaches a stated level for a captioner (the
calibration records it in ``right``).

A checkpoint without a stored calibration answers ``confidence: null`` (there is no fitted curve
to give a number a person could trust) and ``unsure`` only for runaway, empty or failed outputs.
``tellkit calibrate`` fits a calibration from the predictions of ``tellkit evaluate --split val``
and writes it into a copy of the checkpoint (:func:`fit`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tellkit.decoding.runaway import LATEX_CLOSERS, LATEX_OPENERS, latex_policy
from tellkit.errors import TellkitError

FEATURES = ("score", "log_length")  # what the logistic curve reads
META_KEY = "confidence"  # where a checkpoint's config.json stores its calibration
UNSURE_NOTE = "unsure: this looks unlike what the model learned"
DEFAULT_UNSURE_SHARE = 0.1  # fit(): the threshold leaves this share of validation answers unsure


def features(score: float, length: int) -> tuple[float, float]:
    """The inputs of the curve: the length-normalised log-probability and log(1 + tokens)."""
    return float(score), math.log1p(max(int(length), 0))


@dataclass(frozen=True)
class InputCheck:
    """Whether an input looks like those the model learned from: the cosine distance between its
    feature vector (for a captioner, the mean of its image encoder's grid vectors) and the mean
    direction of typical inputs' vectors; beyond ``limit`` it looks unlike them."""

    mean: tuple[float, ...]
    limit: float
    feature: str = "image_mean"  # what is measured
    fitted_on: str = ""

    def __post_init__(self) -> None:
        mean = tuple(float(x) for x in self.mean)
        if not mean or not all(math.isfinite(x) for x in (*mean, self.limit)) or not 0 < self.limit <= 2 \
                or not any(mean):
            raise TellkitError("confidence calibration: the input check needs a finite, non-zero mean direction "
                               "and a limit in (0, 2]")
        object.__setattr__(self, "mean", mean)

    def distance(self, vector) -> float:
        """1 - cos(vector, mean direction): 0 along it, 1 at right angles."""
        v = torch.as_tensor(vector, dtype=torch.float64).flatten()
        if v.numel() != len(self.mean):
            raise TellkitError(f"confidence: the input check measures {len(self.mean)} features, got {v.numel()}")
        m = torch.tensor(self.mean, dtype=torch.float64)
        return float(1.0 - torch.nn.functional.cosine_similarity(v, m, dim=0, eps=1e-12))

    def to_dict(self) -> dict[str, Any]:
        return {"feature": self.feature, "measure": "cosine distance to the mean direction", "limit": self.limit,
                "fitted_on": self.fitted_on, "mean": list(self.mean)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InputCheck:
        try:
            return cls(tuple(d["mean"]), float(d["limit"]), str(d.get("feature", "image_mean")),
                       str(d.get("fitted_on", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise TellkitError(f"confidence calibration: bad input check ({exc})") from None


def fit_input_check(vectors, share: float = 0.01, feature: str = "image_mean", fitted_on: str = "") -> InputCheck:
    """An :class:`InputCheck` from the feature vectors of typical inputs: the mean direction from
    every other one, the limit from the rest (the distance that ``share`` of them exceed), so the
    limit is measured on inputs the mean did not see."""
    x = torch.as_tensor(vectors, dtype=torch.float64)
    if x.ndim != 2 or x.shape[0] < 20:
        raise TellkitError(f"calibrate: at least 20 typical inputs are needed for the input check, got {len(x)}")
    if not 0.0 < share < 0.5:
        raise TellkitError(f"calibrate: the share of typical inputs beyond the limit must be in (0, 0.5), got {share}")
    a, b = x[0::2], x[1::2]
    mean = torch.nn.functional.normalize(a, dim=1).mean(0)
    check = InputCheck(tuple(float(f"{v:.6g}") for v in mean.tolist()), 1.0, feature, fitted_on)  # 6 digits
    dist = sorted(check.distance(v) for v in b)
    limit = dist[min(int(math.ceil((1.0 - share) * len(dist))), len(dist) - 1)]
    return InputCheck(check.mean, float(limit), feature, fitted_on)


@dataclass(frozen=True)
class Calibration:
    """confidence = sigmoid(weights . features(score, length) + bias); unsure below ``threshold``.
    The weight of the score is never negative, so a higher score never lowers the confidence."""

    weights: tuple[float, float]
    bias: float
    threshold: float
    right: str = ""       # what counted as a right answer when it was fitted
    fitted_on: str = ""   # the validation data it was fitted on
    n: int = 0            # answers it was fitted on
    auroc: float | None = None  # how well the confidence separated right from wrong on those answers
    input: InputCheck | None = None  # inputs unlike the training inputs are unsure (optional)

    def __post_init__(self) -> None:
        w = tuple(float(x) for x in self.weights)
        if len(w) != len(FEATURES) or not all(math.isfinite(x) for x in (*w, self.bias, self.threshold)):
            raise TellkitError(f"confidence calibration: {len(FEATURES)} finite weights ({', '.join(FEATURES)}), "
                               f"a finite bias and threshold are needed, got {self.weights!r}, {self.bias!r}, "
                               f"{self.threshold!r}")
        if w[0] < 0:
            raise TellkitError(f"confidence calibration: the weight of the score must not be negative, got {w[0]}")
        if not 0.0 <= self.threshold <= 1.0:
            raise TellkitError(f"confidence calibration: threshold must be in [0, 1], got {self.threshold}")
        object.__setattr__(self, "weights", w)

    def confidence(self, score: float, length: int) -> float:
        z = self.bias + sum(w * x for w, x in zip(self.weights, features(score, length)))
        return _sigmoid(z)

    def to_dict(self) -> dict[str, Any]:
        d = {"method": "logistic", "features": list(FEATURES), "weights": list(self.weights),
             "bias": self.bias, "threshold": self.threshold, "right": self.right, "fitted_on": self.fitted_on,
             "n": self.n, "auroc": self.auroc}
        if self.input is not None:
            d["input"] = self.input.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        if not isinstance(d, Mapping):
            raise TellkitError(f"confidence calibration: expected a mapping, got {type(d).__name__}")
        if d.get("method", "logistic") != "logistic" or list(d.get("features", FEATURES)) != list(FEATURES):
            raise TellkitError(f"confidence calibration: unknown method {d.get('method')!r} or features "
                               f"{d.get('features')!r} (this version reads logistic on {', '.join(FEATURES)})")
        try:
            return cls(tuple(d["weights"]), float(d["bias"]), float(d["threshold"]), str(d.get("right", "")),
                       str(d.get("fitted_on", "")), int(d.get("n", 0)),
                       None if d.get("auroc") is None else float(d["auroc"]),
                       None if d.get("input") is None else InputCheck.from_dict(d["input"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TellkitError(f"confidence calibration: missing or bad field ({exc})") from None


def from_meta(meta: Mapping[str, Any]) -> Calibration | None:
    """The calibration a checkpoint's ``config.json`` stores, or None (none stored)."""
    d = meta.get(META_KEY)
    return None if d is None else Calibration.from_dict(d)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def runaway(tokens: Sequence[Any], max_len: int | None = None) -> bool:
    """Whether an answer ran away: it reached the search's ``max_len``, its tokens end in a
    long repeat or cycle, or it nests LaTeX groups deeper than any training expression (the rules
    of :class:`~tellkit.decoding.runaway.RunawayStop`, which also stops such searches early)."""
    n = len(tokens)
    if max_len is not None and n >= int(max_len):
        return True
    if n < 2:
        return False
    ids: dict[Any, int] = {t: i for i, t in enumerate(LATEX_OPENERS + LATEX_CLOSERS)}  # both kinds always known
    t = torch.tensor([ids.setdefault(x, len(ids)) for x in tokens], dtype=torch.long).view(1, 1, n)
    # the repeat, cycle and depth rules only: the score floor is the calibration's business
    return bool(latex_policy(ids, floor=-1e9).stopped(t, torch.zeros(1, 1))[0])


def assess(calibration: Calibration | None, score: float | None, tokens: Sequence[Any],
           max_len: int | None = None, features: Any = None) -> dict[str, Any]:
    """``{"confidence", "unsure"}`` of one answer (see the module docstring); ``features``: the
    input's feature vector, for a calibration with an :class:`InputCheck` (an input unlike the
    training inputs is unsure, its confidence at most the threshold)."""
    broken = score is None or not math.isfinite(score) or not tokens or runaway(tokens, max_len)
    if calibration is not None and calibration.input is not None and features is not None:
        broken = broken or calibration.input.distance(features) > calibration.input.limit
    if calibration is None:
        return {"confidence": None, "unsure": bool(broken)}
    conf = 0.0 if score is None or not math.isfinite(score) else calibration.confidence(score, len(tokens))
    if broken:
        conf = min(conf, calibration.threshold)
    return {"confidence": round(conf, 4), "unsure": bool(broken or conf < calibration.threshold)}


# --- fitting and measuring --------------------------------------------------------------------
def auroc(values: Sequence[float], right: Sequence[bool]) -> float | None:
    """The chance that a right answer's value is above a wrong one's (ties count half); None
    without both kinds."""
    pos = [float(v) for v, r in zip(values, right) if r]
    neg = [float(v) for v, r in zip(values, right) if not r]
    if not pos or not neg:
        return None
    ranked = sorted([(v, 1) for v in pos] + [(v, 0) for v in neg])
    rank_sum, i = 0.0, 0
    while i < len(ranked):  # average ranks over ties
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + 1 + j) / 2
        rank_sum += mean_rank * sum(1 for k in range(i, j) if ranked[k][1])
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def fit(scores: Sequence[float], lengths: Sequence[int], right: Sequence[bool], *,
        unsure_share: float = DEFAULT_UNSURE_SHARE, l2: float = 1e-3, right_means: str = "",
        fitted_on: str = "") -> Calibration:
    """A logistic curve of right (1) / wrong (0) on :func:`features`, by Newton's method with a
    small L2 penalty on the weights; the threshold is the confidence below which
    ``unsure_share`` of these answers fall. Answers without a score are left out of the fit."""
    rows = [(features(s, n), bool(r)) for s, n, r in zip(scores, lengths, right)
            if s is not None and math.isfinite(s)]
    if len(rows) < 10:
        raise TellkitError(f"calibrate: at least 10 scored answers are needed, got {len(rows)}")
    if all(r for _, r in rows) or not any(r for _, r in rows):
        raise TellkitError("calibrate: the answers are all right or all wrong; a curve needs both")
    if not 0.0 <= unsure_share < 1.0:
        raise TellkitError(f"calibrate: the unsure share must be in [0, 1), got {unsure_share}")
    x = torch.tensor([[*f, 1.0] for f, _ in rows], dtype=torch.float64)
    y = torch.tensor([float(r) for _, r in rows], dtype=torch.float64)
    mean, std = x[:, :-1].mean(0), x[:, :-1].std(0).clamp_min(1e-6)
    xs = torch.cat([(x[:, :-1] - mean) / std, x[:, -1:]], 1)  # standardised for a well-scaled Newton step
    w = torch.zeros(xs.shape[1], dtype=torch.float64)
    penalty = torch.diag(torch.tensor([l2] * (xs.shape[1] - 1) + [0.0], dtype=torch.float64)) * len(rows)
    for _ in range(100):
        p = torch.sigmoid(xs @ w)
        grad = xs.T @ (p - y) + penalty @ w
        hess = (xs * (p * (1 - p))[:, None]).T @ xs + penalty + 1e-9 * torch.eye(len(w), dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    weights = (w[:-1] / std)
    bias = float(w[-1] - (w[:-1] * mean / std).sum())
    if float(weights[0]) < 0:  # the score carries no usable signal here: read the length only
        keep = fit_length_only(xs, y, penalty)
        weights = torch.tensor([0.0, float(keep[0] / std[1])], dtype=torch.float64)
        bias = float(keep[1] - keep[0] * mean[1] / std[1])
    cal = Calibration((float(weights[0]), float(weights[1])), bias, 0.0, right_means, fitted_on, len(rows))
    confs = sorted(cal.confidence(s, n) for s, n in zip(scores, lengths) if s is not None and math.isfinite(s))
    threshold = confs[min(int(unsure_share * len(confs)), len(confs) - 1)] if unsure_share > 0 else 0.0
    measured = auroc([cal.confidence(s, n) for s, n, _ in _scored(scores, lengths, right)],
                     [r for _, _, r in _scored(scores, lengths, right)])
    return Calibration(cal.weights, cal.bias, float(threshold), right_means, fitted_on, len(rows),
                       None if measured is None else round(measured, 4))


def _scored(scores, lengths, right):
    return [(s, n, bool(r)) for s, n, r in zip(scores, lengths, right) if s is not None and math.isfinite(s)]


def fit_length_only(xs: torch.Tensor, y: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """(weight, bias) of a logistic curve on the standardised log length alone."""
    x = xs[:, 1:]
    w = torch.zeros(2, dtype=torch.float64)
    pen = penalty[1:, 1:]
    for _ in range(100):
        p = torch.sigmoid(x @ w)
        step = torch.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + pen + 1e-9 * torch.eye(2, dtype=torch.float64),
                                  x.T @ (p - y) + pen @ w)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    return w


def describe(result: Mapping[str, Any]) -> str:
    """A result's confidence in words, for plain-text output: ``confidence 0.83``,
    ``unsure (confidence 0.12): this looks unlike what the model learned``, or ``""`` for a
    model without calibration whose answer is not flagged."""
    conf = result.get("confidence")
    number = f"confidence {conf:.2f}" if isinstance(conf, (int, float)) else ""
    if result.get("unsure"):
        return f"unsure ({number}): {UNSURE_NOTE[len('unsure: '):]}" if number else UNSURE_NOTE
    return number
