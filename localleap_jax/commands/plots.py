"""The paper's decoding-dynamics figures from a `Trace`: one function per figure.

Each `figure*` function writes DIR/<name>.png and DIR/<name>.json (the numbers drawn, straight from
`localleap_jax.dynamics`) and returns that JSON's dict. matplotlib runs on the non-interactive Agg
backend, so this works on a headless machine.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: never open a window
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
from jaxtyping import Float  # noqa: E402

from localleap_jax import dynamics as dyn  # noqa: E402
from localleap_jax.trace import Trace  # noqa: E402

CONSISTENT_RGB = np.array([0.10, 0.55, 0.20])  # green
INCONSISTENT_RGB = np.array([0.80, 0.10, 0.10])  # red
DECIDED_RGB = np.array([0.82, 0.82, 0.82])  # grey: the position was already committed before this pass
UNOBSERVED_RGB = np.array([1.0, 1.0, 1.0])  # white: the pass did not compute the position


def jsonable(x: Any) -> Any:
    """NumPy values as plain JSON (NaN and inf become null, which strict JSON readers accept)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    return x


def write_json(path: Path, data: dict) -> None:
    """Write `data` as JSON, replacing `path` whole (a run ended mid-write leaves the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False))
    os.replace(tmp, path)


def _save(fig, out: Path, name: str, data: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    write_json(out / f"{name}.json", data)
    return jsonable(data)


def _percent(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.1f}%"


# ---------------------------------------------------------------- Figure 1a


def picture_rgb(pic: dyn.DecodePicture) -> Float[np.ndarray, "S G 3"]:
    """Green (consistent) or red (not) faded towards white as confidence falls; grey once committed."""
    conf = np.clip(np.nan_to_num(pic.conf, nan=0.0), 0.0, 1.0)[..., None]
    hue = np.where(pic.consistent[..., None], CONSISTENT_RGB, INCONSISTENT_RGB)
    rgb = 1.0 - conf * (1.0 - hue)  # intensity: white at confidence 0, full colour at 1
    rgb = np.where((pic.observed & ~pic.masked)[..., None], DECIDED_RGB, rgb)
    return np.where(pic.observed[..., None], rgb, UNOBSERVED_RGB)


def figure1a(trace: Trace, out: Path, row: int = 0, text: str | None = None) -> dict:
    """One row's decode: positions (x) by passes (y, downwards); a black dot where each token committed."""
    pic = dyn.decode_picture(trace, row)
    S, G = pic.conf.shape
    fig, ax = plt.subplots(figsize=(min(2 + G / 12, 22), min(1.5 + S / 12, 22)))
    ax.imshow(picture_rgb(pic), aspect="auto", interpolation="nearest", extent=(-0.5, G - 0.5, S - 0.5, -0.5))
    committed = np.flatnonzero(pic.commit_pass >= 0)
    ax.scatter(committed, pic.commit_pass[committed], s=max(2, 400 / max(G, S)), c="black", marker="o",
               label="committed")
    ax.set_xlabel("generated position")
    ax.set_ylabel("pass")
    ax.set_title(f"Figure 1a: row {row}, {S} passes — green: prediction = final token, red: not; "
                 "intensity: confidence; grey: already committed")
    ax.legend(loc="upper right", fontsize=7)
    data = {"row": row, "passes": S, "gen_length": G, "text": text,
            "consistent": pic.consistent, "conf": pic.conf, "masked": pic.masked, "observed": pic.observed,
            "commit_pass": pic.commit_pass, "token": pic.token}
    return _save(fig, out, "figure1a", data)


# ---------------------------------------------------------------- Figure 1b


def figure1b(trace: Trace, out: Path, cache: str | None = None) -> dict:
    """Histogram of the earliest stable-consistency step / passes, its cumulative share, the 25% line."""
    edges = dyn.FRACTION_EDGES
    counts = dyn.stable_histogram(trace, edges)
    n = int(dyn.decided(trace).sum())  # the denominator of stable_within (a never-stable position is 'not within')
    share = dyn.stable_within(trace, 0.25)
    cumulative = np.cumsum(counts) / max(n, 1)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(edges[:-1], counts / max(n, 1), width=np.diff(edges), align="edge", color="#4c72b0",
           edgecolor="white", label="positions")
    ax.plot(edges[1:], cumulative, color="black", marker=".", label="cumulative")
    ax.axvline(0.25, color="grey", linestyle="--")
    ax.set_xlabel("earliest stable-consistency step / total passes")
    ax.set_ylabel("share of positions")
    ax.set_xlim(0, 1)
    paper = _percent(dyn.PAPER['stable_within_25pct'])
    caveat = (f"\n--cache {cache}: a position is predicted only once its block opens; not comparable to the "
              f"paper's no-cache {paper}" if cache is not None and cache not in dyn.COMPARABLE_CACHES else "")
    ax.set_title(f"Figure 1b: {_percent(share)} stable within 25% of the passes (paper, no cache: {paper}){caveat}",
                 fontsize=10 if not caveat else 8)
    ax.legend(loc="center right")
    data = {"definition": "fraction = (stable pass + 1) / row passes; within 25% means fraction <= 0.25",
            "edges": edges, "counts": counts, "cumulative": cumulative, "positions": n,
            "stable_within_25pct": share, "paper_stable_within_25pct": dyn.PAPER["stable_within_25pct"],
            "cache": cache, "means": dyn.STABLE_MEANING.get(cache, "the traces do not record their cache mode")}
    return _save(fig, out, "figure1b", data)


# ---------------------------------------------------------------- Figure 1c


def figure1c(trace: Trace, out: Path) -> dict:
    """Consistency with the final token per confidence bin (bars) and the number of predictions per bin."""
    binned = dyn.consistency_by_confidence(trace)
    share = dyn.consistent_given_confidence_above(trace, 0.8)
    edges = binned.edges
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(edges[:-1], np.nan_to_num(binned.rate), width=np.diff(edges), align="edge", color="#55a868",
           edgecolor="white")
    for lo, width, n in zip(edges[:-1], np.diff(edges), binned.total):
        ax.text(lo + width / 2, 1.01, str(int(n)), ha="center", va="bottom", fontsize=6, color="grey")
    ax.axvline(0.8, color="grey", linestyle="--")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("confidence of the prediction at a still-masked position")
    ax.set_ylabel("share equal to the final token")
    ax.set_title(f"Figure 1c: {_percent(share)} of predictions with confidence > 0.8 are consistent "
                 f"(paper {_percent(dyn.PAPER['consistent_given_conf_gt_0.8'])})", fontsize=9)
    data = {"edges": edges, "consistent": binned.consistent, "total": binned.total, "rate": binned.rate,
            "consistent_given_conf_gt_0.8": share,
            "paper_consistent_given_conf_gt_0.8": dyn.PAPER["consistent_given_conf_gt_0.8"]}
    return _save(fig, out, "figure1c", data)


# ---------------------------------------------------------------- Figure 2


def figure2(trace: Trace, out: Path, max_distance: int = 8, anchor_split: float = 0.9) -> dict:
    """Neighbour consistency by (|distance|, neighbour confidence), one heatmap per anchor-confidence panel."""
    nb = dyn.neighbour_consistency(trace, max_distance=max_distance, anchor_split=anchor_split)
    rate = nb.rate
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    titles = (f"committed token confidence >= {anchor_split}", f"committed token confidence < {anchor_split}")
    for p, (ax, title) in enumerate(zip(axes, titles)):
        im = ax.imshow(np.ma.masked_invalid(rate[p]), origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1,
                       extent=(nb.edges[0], nb.edges[-1], 0.5, max_distance + 0.5))
        centres = (nb.edges[:-1] + nb.edges[1:]) / 2
        for d in range(max_distance):
            for k, x in enumerate(centres):
                if nb.total[p, d, k]:
                    ax.text(x, d + 1, f"{rate[p, d, k]:.2f}", ha="center", va="center", fontsize=5,
                            color="white" if rate[p, d, k] < 0.6 else "black")
        ax.set_title(f"{title} ({int(nb.total[p].sum())} pairs)", fontsize=9)
        ax.set_xlabel("neighbour confidence")
    axes[0].set_ylabel("|distance| to the committed token")
    fig.colorbar(im, ax=axes, label="share of still-masked neighbours equal to their final token")
    fig.suptitle("Figure 2: consistency of the neighbours of a token committed at a pass")
    data = {"distances": np.arange(1, max_distance + 1), "edges": nb.edges, "anchor_split": anchor_split,
            "panels": {"conf_ge_split": {"consistent": nb.consistent[0], "total": nb.total[0], "rate": rate[0]},
                       "conf_lt_split": {"consistent": nb.consistent[1], "total": nb.total[1], "rate": rate[1]}}}
    return _save(fig, out, "figure2", data)


def all_figures(trace: Trace, out: Path, row: int = 0, texts: list[str] | None = None, cache: str | None = None
                ) -> dict[str, dict]:
    """Every figure into `out`; returns {name: its JSON dict}. `cache`: the traces' cache mode (Figure 1b's caveat)."""
    text = texts[row] if texts is not None and row < len(texts) else None
    return {"figure1a": figure1a(trace, out, row, text), "figure1b": figure1b(trace, out, cache),
            "figure1c": figure1c(trace, out), "figure2": figure2(trace, out)}


# ---------------------------------------------------------------- sweeps (experiments/sweep.py)

# One colour per rule, the same in every sweep figure; the two rules the paper compares are drawn bolder.
RULE_COLOURS = {"low_confidence": "#7f7f7f", "threshold": "#1f77b4", "localleap": "#d62728", "factor": "#2ca02c",
                "eb": "#9467bd", "margin": "#8c564b", "entropy": "#e377c2", "klass": "#bcbd22", "stable": "#17becf"}
HIGHLIGHT = ("localleap", "threshold")


def staircase(frontier_xy: list[tuple[float, float]], lower_is_better: bool, edge: float
              ) -> tuple[list[float], list[float], str]:
    """(xs, ys, matplotlib drawstyle) of a frontier's step function 'best accuracy at this cost or cheaper',
    extended to `edge` (the axis' far end on the expensive side), so a one-point frontier still shows."""
    if lower_is_better:  # NFE: a point's accuracy holds from its x rightwards
        pts = sorted(frontier_xy)
        return [x for x, _ in pts] + [edge], [y for _, y in pts] + [pts[-1][1]], "steps-post"
    pts = sorted(frontier_xy, reverse=True)  # tokens/s: from its x leftwards
    return [edge] + [x for x, _ in reversed(pts)], [pts[-1][1]] + [y for _, y in reversed(pts)], "steps-pre"


def pareto_plot(path: Path, points: dict, pareto: dict, metric: str) -> None:
    """Accuracy against mean NFE (left) and tokens/s (right): every point of every rule's grid, and each
    rule's frontier as the step function 'best accuracy at that cost or cheaper'."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("mean_nfe", "mean NFE (forward passes per problem)", True),
              ("tokens_per_second", "tokens/s (this machine)", False))
    for ax, (x_key, label, lower_is_better) in zip(axes, panels):
        every = [points[s][x_key] for rec in pareto.values() for s in rec["points"]]
        edge = max(every) if lower_is_better else min(every)
        for name, rec in pareto.items():
            colour, bold = RULE_COLOURS.get(name, "black"), name in HIGHLIGHT
            ax.scatter([points[s][x_key] for s in rec["points"]], [points[s][metric] for s in rec["points"]],
                       s=30 if bold else 16, color=colour, alpha=0.75, label=name, zorder=3,
                       marker="o" if bold else "s")
            xs, ys, style = staircase([(points[s][x_key], points[s][metric]) for s in rec[f"frontier_{x_key}"]],
                                      lower_is_better, edge)
            ax.plot(xs, ys, drawstyle=style, color=colour, linewidth=2.0 if bold else 1.0, alpha=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    nfe = [points[s]["mean_nfe"] for rec in pareto.values() for s in rec["points"]]
    if max(nfe) > 4 * min(nfe):  # a wide NFE range (a 1-token baseline beside parallel rules): log, powers of 2
        axes[0].set_xscale("log", base=2)
        axes[0].xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_ylabel(f"accuracy ({metric.removeprefix('accuracy_')})")
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=1))
    axes[1].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=1))
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle("Accuracy against cost per strategy grid; lines: Pareto frontiers "
                 "(best accuracy at that cost or cheaper)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def figure4_plot(path: Path, record: dict, metric: str) -> None:
    """Figure 4: one column per ablated setting (kappa, W, tau), rows accuracy / tokens/s / mean NFE, the
    centre's value dotted, the 1-token baseline dashed."""
    rows = ((metric, f"accuracy ({metric.removeprefix('accuracy_')})"), ("tokens_per_second", "tokens/s"),
            ("mean_nfe", "mean NFE"))
    names = {"kappa": "kappa (anchor threshold)", "radius": "W (radius)", "tau": "tau (relaxed threshold)"}
    ablations = record["ablations"]
    fig, axes = plt.subplots(len(rows), len(ablations), figsize=(3.3 * len(ablations), 6.5), squeeze=False,
                             sharex="col", sharey="row")
    base = record["baseline"]
    for j, (key, series) in enumerate(ablations.items()):
        xs = [s["value"] for s in series]
        for i, (y_key, label) in enumerate(rows):
            ax = axes[i, j]
            ys = [s[y_key] for s in series]
            ax.plot(xs, ys, marker="o", color=RULE_COLOURS["localleap"], label="localleap")
            for x, y in zip(xs, ys):  # the values: differences can be far smaller than the baseline's scale
                ax.annotate(f"{100 * y:.1f}%" if i == 0 else f"{y:.2f}" if y < 100 else f"{y:.0f}", (x, y),
                            textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6)
            ax.axhline(base[y_key], color="black", linestyle="--", linewidth=1, label=f"{base['spec']} (1 token/step)")
            ax.axvline(record["center"][key], color="grey", linestyle=":", linewidth=1)
            ax.grid(alpha=0.3)
            ax.margins(y=0.2)  # room for the value labels
            if j == 0:
                ax.set_ylabel(label)
            if i == 0:
                ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=1))
        axes[-1, j].set_xlabel(names.get(key, key))
    axes[0, 0].legend(fontsize=7)
    c = record["center"]
    fig.suptitle(f"Figure 4: ablations around kappa={c['kappa']:g}, W={c['radius']}, tau={c['tau']:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- run as a program

USAGE = """usage: python experiments/analyze_dynamics.py --output DIR                     (trace a model, then draw)
       python experiments/analyze_dynamics.py --from-traces DIR/traces --output DIR2   (draw saved traces)

localleap_jax.commands.plots draws the paper's decoding-dynamics figures (1a, 1b, 1c, 2) for analyze_dynamics,
from a Trace (figure1a, figure1b, figure1c, figure2, all_figures); it is not a command of its own. The commands
above draw them."""


def main(argv=None) -> int:
    """`python -m localleap_jax.commands.plots`: say which command draws the figures (status 2)."""
    import sys

    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(main())
