"""What the notebooks share: where the results and figures are, one plotting style,
one colour per strategy, and `save` (PNG + PDF + caption file).

    DBS_MPI_GRID     folder of result files (default: results/grid)
    DBS_MPI_FIGURES  where figures and captions go (default: analysis/figures)

Captions are computed from the result files in the notebooks; `save` writes each to
<figures>/<name>.md, from which analysis/readme.py builds the README's "Figures" section.
"""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _root() -> Path:
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "setup.cfg").exists() and (folder / "dbs_mpi").is_dir():
            return folder
    return Path(__file__).resolve().parents[1]


ROOT = _root()
GRID = Path(os.environ.get("DBS_MPI_GRID") or ROOT / "results" / "grid")
FIGURES = Path(os.environ.get("DBS_MPI_FIGURES") or ROOT / "analysis" / "figures")

COLOURS = {"ssgd": "#7f7f7f", "static": "#1f77b4", "dbs": "#d62728", "dbs-epoch": "#e377c2",
           "asgd": "#9467bd", "nsoftsync": "#2ca02c", "dbs-sgd": "#ff7f0e",
           "weighted": "#d62728", "mean": "#1f77b4"}
ORDER = ["ssgd", "static", "dbs-epoch", "dbs", "asgd", "nsoftsync", "dbs-sgd"]
LABELS = {"nsoftsync": "1-softsync", "dbs-epoch": "dbs, per epoch", "dbs": "dbs"}
PHASE_COLOURS = {"compute": "#4c72b0", "comm": "#dd8452", "wait": "#c44e52", "data": "#8c8c8c"}


def style() -> None:
    plt.rcParams.update({
        "figure.dpi": 110, "savefig.dpi": 150, "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10,
        "legend.fontsize": 9, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
        "axes.spines.right": False, "figure.constrained_layout.use": True})


def label(strategy: str) -> str:
    return LABELS.get(strategy, strategy)


def ordered(values) -> list:
    values = list(dict.fromkeys(values))
    return sorted(values, key=lambda v: ORDER.index(v) if v in ORDER else len(ORDER))


def save(fig, name: str, caption: str, short: str | None = None):
    """Write <name>.png, <name>.pdf, <name>.md (the caption) and, for a figure the README
    shows, <name>.short.md (`short`: its claim, its key number, held or not, in about 60
    words); return the caption as Markdown for the notebook to display."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    # No creation date or software version in the files: the same figure gives the same
    # bytes, so re-drawing unchanged figures leaves the tree clean.
    fig.savefig(FIGURES / f"{name}.png", metadata={"Software": None})
    fig.savefig(FIGURES / f"{name}.pdf", metadata={"CreationDate": None, "Producer": None, "Creator": None})
    (FIGURES / f"{name}.md").write_text(caption.strip() + "\n")
    if short is not None:
        (FIGURES / f"{name}.short.md").write_text(short.strip() + "\n")
    try:
        from IPython.display import Markdown
        return Markdown(f"**Figure `{name}`.** " + caption)
    except ImportError:  # pragma: no cover
        return caption


def verdict(held: bool | None) -> str:
    return {True: "**held**", False: "**did not hold**", None: "**not decided**"}[held]


def fmt_list(values, spec: str = ".2f") -> str:
    return ", ".join(format(v, spec) for v in values)


def load_text(runs) -> str:
    """' (load average a to b)' over the runs' grid_loadavg attributes, or ''."""
    if "grid_loadavg" not in runs:
        return ""
    values = [v for x in runs.grid_loadavg if isinstance(x, (tuple, list, np.ndarray)) for v in x]
    return (f" (1-minute load average {min(values):.1f} to {max(values):.1f}, the grid's own ranks included)"
            if values else "")
