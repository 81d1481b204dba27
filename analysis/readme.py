"""Build the figures' index from the captions the notebooks wrote, and check it.

    python analysis/readme.py                 # analysis/figures/README.md + README.md's "Figures" section
    python analysis/readme.py --check DIR     # every figure of FIGURES has its PNG, PDF and caption in DIR

The captions (<figures>/<name>.md, and <name>.short.md for the figures README.md shows)
are computed in the notebooks from the result files; this script only places them: the
short ones in README.md, the full ones in analysis/figures/README.md. In README.md it replaces what lies between the markers
`<!-- figures:start -->` and `<!-- figures:end -->`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- figures:start -->", "<!-- figures:end -->"

# (name, title, notebook, shown in the top-level README)
FIGURES = [
    ("loss-time", "Training loss against wall time", "strategies.ipynb", True),
    ("accuracy-epoch", "Test accuracy against epoch and time", "strategies.ipynb", False),
    ("batch-vector", "The batch vector under disturbances", "disturbance.ipynb", True),
    ("utilisation", "Per-rank utilisation", "strategies.ipynb", False),
    ("dbs-vectors", "The batch vectors of the strategy runs", "strategies.ipynb", False),
    ("aggregation", "Weighted against mean aggregation", "aggregation.ipynb", True),
    ("speedup", "Measured against ideal speed-up", "speedup.ipynb", False),
    ("async-loss", "dbs-sgd against asgd and 1-softsync: loss over time", "async.ipynb", False),
    ("async-staleness", "Staleness distributions", "async.ipynb", False),
    ("dbs-sgd-study", "dbs-sgd against asgd and 1-softsync: 7 workers, 3 learning rates, 3 seeds", "async.ipynb",
     False),
    ("adaptive-batch", "The global batch that adapts, against fixed global batches", "adaptive.ipynb", False),
    ("simulation", "Projected speed-up and communication share, 8 to 4,096 ranks (simulated)", "simulation.ipynb",
     False),
]


def caption(folder: Path, name: str, short: bool = False) -> str | None:
    """A figure's caption: the full one (<name>.md), or with short=True its short one
    (<name>.short.md: the claim, the key number, held or not), else the full one."""
    path = folder / f"{name}.short.md"
    if not (short and path.exists()):
        path = folder / f"{name}.md"
    return path.read_text().strip() if path.exists() else None


def index(folder: Path) -> str:
    """analysis/figures/README.md: every figure with its caption."""
    lines = ["# Figures", "",
             "Made by `make figures` from the result files in `results/grid/` (see `results/grid/README.md`); "
             "each caption is computed by its notebook in `analysis/` from those files. PDF versions beside "
             "the PNGs.", ""]
    for name, title, notebook, _ in FIGURES:
        text = caption(folder, name)
        if text is None:
            continue
        lines += [f"## {title}", "", f"![{name}]({name}.png)", "",
                  f"**`{name}`** ([PDF]({name}.pdf), notebook [`{notebook}`](../{notebook})). {text}", ""]
    return "\n".join(lines)


def section(folder: Path) -> str:
    """The README's Figures section body: main figures with captions, links to the rest."""
    rel = folder.resolve().relative_to(ROOT) if folder.resolve().is_relative_to(ROOT) else folder
    lines = [START, "",
             "From the committed small grid (`results/grid/`, 2-core machine, emulated heterogeneity; "
             "`make experiments` re-runs it, `make figures` re-draws these and rewrites this section). "
             "Numbers in the captions are computed from the result files by the notebooks in `analysis/`. "
             f"All figures with their full captions (what was run, every number, the criteria): "
             f"[`{rel}/README.md`]({rel}/README.md).", ""]
    rest = []
    for name, title, notebook, main in FIGURES:
        text = caption(folder, name, short=main)
        if text is None:
            continue
        if main:
            lines += [f"**{title}** (`{name}`, [`analysis/{notebook}`](analysis/{notebook}))", "",
                      f"![{name}]({rel}/{name}.png)", "", text, ""]
        else:
            rest.append(f"- [{title}]({rel}/{name}.png) ([PDF]({rel}/{name}.pdf)), "
                        f"[`analysis/{notebook}`](analysis/{notebook})")
    if rest:
        lines += ["More figures:", "", *rest, ""]
    return "\n".join(lines + [END])


def update_readme(readme: Path, folder: Path) -> bool:
    text = readme.read_text()
    if START not in text or END not in text:
        print(f"{readme}: no {START} ... {END} markers; section not written", file=sys.stderr)
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + section(folder) + tail)
    return True


def check(folder: Path) -> list[str]:
    problems = []
    for name, _, _, main in FIGURES:
        for ext in ("png", "pdf", "md") + (("short.md",) if main else ()):
            path = folder / f"{name}.{ext}"
            if not path.exists() or path.stat().st_size == 0:
                problems.append(f"missing {path}")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", default=str(ROOT / "analysis" / "figures"), help="folder of figures and captions")
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--check", metavar="DIR", help="only check that DIR has every figure")
    args = p.parse_args(argv)
    if args.check:
        problems = check(Path(args.check))
        for line in problems:
            print(line, file=sys.stderr)
        print(f"{len(FIGURES) - len({p.split('/')[-1].rsplit('.', 1)[0] for p in problems})} of {len(FIGURES)} "
              f"figures complete in {args.check}")
        return 1 if problems else 0
    folder = Path(args.figures)
    (folder / "README.md").write_text(index(folder))
    update_readme(Path(args.readme), folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
