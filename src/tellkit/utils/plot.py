"""Training curves a person can read (``tellkit curve --png``): one panel per kind of quantity
(loss, percentages, counts, ...), each with its unit on the y axis, and the chosen (best)
evaluation marked on every panel. Drawn with matplotlib (the ``plot`` extra), imported only when
a figure is made; no pyplot, so no global state and no display is needed."""
from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

from tellkit.utils.optional import require

# kind -> y-axis label, in the order the panels are stacked
PANELS = {
    "loss": "loss (nats per token)",
    "percent": "score (%)",
    "count": "count (samples)",
    "words": "words per caption",
    "other": "value (as logged)",
}
# tellkit's metrics in percent: ExpRate, the caption metrics (x100), ROUGE, Content F1, entity precision/recall
PERCENT_PREFIXES = ("exprate", "bleu", "meteor", "rouge", "cider", "spice", "content_f1", "accuracy")
PERCENT_SUFFIXES = ("_precision", "_recall", "_f1")
COUNT_NAMES = ("n", "count", "samples", "num")
X_LABELS = {"epoch": "completed epochs", "step": "optimizer steps"}


def metric_kind(name: str) -> str:
    """Which panel a validation metric belongs to, from its name (``loss``, ``exprate_le1``, ``n``...)."""
    low = name.lower()
    if low == "loss" or low.endswith("_loss") or low in ("nll", "ppl_loss"):
        return "loss"
    if low in COUNT_NAMES or low.startswith(("n_", "num_", "count_")):
        return "count"
    if low == "length":
        return "words"
    if low.startswith(PERCENT_PREFIXES) or low.endswith(PERCENT_SUFFIXES):
        return "percent"
    return "other"


def finite_points(evaluations: Sequence[Mapping], metric: str, x: str) -> list[tuple[float, float]]:
    """(x, value) of ``metric`` over the evaluations, non-finite values left out."""
    return [(e[x], e[metric]) for e in evaluations
            if metric in e and isinstance(e[metric], (int, float)) and math.isfinite(e[metric])]


def curve_figure(evaluations: Sequence[Mapping], metrics: Sequence[str], *, x: str = "epoch", title: str = "",
                 chosen_step: int | None = None):
    """A matplotlib ``Figure``: one panel per kind of metric (stacked, sharing the x axis), one
    line per metric, the evaluation at ``chosen_step`` marked with a dashed line on every panel
    and a ring on each point. ``evaluations`` are dicts with ``step``, ``epoch`` and one value
    per metric; non-finite values are left out (see :func:`finite_points`)."""
    require("matplotlib", "plot", "tellkit curve --png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional
    from matplotlib.figure import Figure  # optional
    from matplotlib.ticker import MaxNLocator  # optional

    series = {m: finite_points(evaluations, m, x) for m in metrics}
    kinds = [k for k in PANELS if any(series[m] and metric_kind(m) == k for m in metrics)]
    if not kinds:
        raise ValueError("nothing to plot: no finite value in any series")
    chosen = next((e for e in evaluations if e["step"] == chosen_step), None) if chosen_step is not None else None
    ratios = [0.6 if k == "count" else 1.0 for k in kinds]  # a count is usually flat: a low panel
    fig = Figure(figsize=(8, 1.2 + 2.6 * sum(ratios)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(kinds), 1, sharex=True, squeeze=False, height_ratios=ratios)[:, 0]
    colours = iter(f"C{i}" for i in range(1000))
    for ax, kind in zip(axes, kinds):
        for m in (m for m in metrics if metric_kind(m) == kind and series[m]):
            colour = next(colours)
            xs, ys = zip(*sorted(series[m]))
            ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.6, color=colour, label=m)
            if chosen is not None and m in chosen and math.isfinite(chosen[m]):
                ax.plot([chosen[x]], [chosen[m]], marker="o", markersize=10, markerfacecolor="none",
                        markeredgewidth=1.6, color=colour)
        if chosen is not None:
            ax.axvline(chosen[x], color="0.35", linestyle="--", linewidth=1)
        label = PANELS[kind]
        if kind == "percent" and any(m.lower().startswith("cider") for m in metrics):
            label = "score (%; CIDEr x 100)"  # CIDEr is logged x 100 like the others, and may pass 100
        ax.set_ylabel(label)
        ax.grid(True, color="0.9")
        ax.legend(loc="best", fontsize="small", frameon=False)
        if kind == "count":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
            ax.set_ylim(bottom=0, top=1.15 * max(y for m in metrics if metric_kind(m) == kind
                                                 for _, y in series[m]) + 1)
    axes[-1].set_xlabel(X_LABELS[x])
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if chosen is not None:
        axes[0].set_title(f"dashed: the chosen evaluation (epoch {chosen['epoch']}, step {chosen['step']})",
                          fontsize="small", loc="left", color="0.3")
    if title:
        fig.suptitle(title)
    return fig


def figure_png(fig) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
