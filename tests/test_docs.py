"""The docs: self-contained (every relative link in the repository's Markdown resolves to
a file inside it, and to a heading of it where it names one; nothing refers to files
outside the repository), and matching the code (the options, the result schema)."""
import re
import subprocess

import pytest

from conftest import ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked(*patterns):
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard",
                          *patterns], capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).exists()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (its slugger): the text as rendered (code marks and
    emphasis stars dropped), lower case, every character but letters, digits, spaces,
    hyphens and underscores dropped (underscores are kept: dbs_mpi stays dbs_mpi), each
    space a hyphen."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r" ", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path):
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    found, seen = set(), {}
    for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M):
        base = slug(m.group(1))
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_the_anchors_follow_githubs_rules():
    assert slug("DistributedDataParallel: `dbs_mpi.sample_weighted(ddp_model, balancer=None)`") == \
        "distributeddataparallel-dbs_mpisample_weightedddp_model-balancernone"
    assert slug("`dbs_mpi.DistributedOptimizer(optimizer, model, balancer, ...)`") == \
        "dbs_mpidistributedoptimizeroptimizer-model-balancer-"
    assert slug("1. Sample-weighted gradients") == "1-sample-weighted-gradients"


MARKDOWN = tracked("*.md")


def test_there_is_markdown_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "docs/method.md", "docs/api.md", "docs/results.md", "examples/README.md"} <= names


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(path):
    bad = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(ROOT.resolve()):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_nothing_refers_to_files_outside_the_repository():
    """The project's own docs replaced the research notes that lived beside the checkout."""
    offenders = []
    for path in tracked("*.md", "*.py", "*.ipynb", "*.toml", "*.sh", "*.cfg", "Makefile", "*.sbatch", "*.pbs"):
        text = path.read_text(errors="replace")
        if "../shared" in text or "RESEARCH.md" in text:
            offenders.append(path.relative_to(ROOT).as_posix())
    offenders = [o for o in offenders if o != "tests/test_docs.py"]
    assert not offenders, offenders


# --- the docs match the code ------------------------------------------------------------

def between(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    assert start in text and end in text, f"no {name} markers"
    return text[text.index(start) + len(start):text.index(end)].strip()


def test_the_result_schema_in_the_docs_is_the_code_s():
    from dbs_mpi.training.results import schema_markdown
    assert between((ROOT / "docs/results.md").read_text(), "schema") == schema_markdown().strip(), \
        "docs/results.md drifted from dbs_mpi/training/results.py: python -m dbs_mpi.training.results --markdown"


def test_the_options_table_in_the_docs_is_the_code_s():
    from dbs_mpi.tools.cli import RESUME_MAY_CHANGE
    from dbs_mpi.tools.config import options_markdown
    text = (ROOT / "docs/options.md").read_text()
    assert between(text, "options") == options_markdown().strip(), \
        "docs/options.md drifted from dbs_mpi/tools/config.py: python -m dbs_mpi.tools.config --markdown"
    sentence = " ".join(text[text.index("--resume RESULT.h5"):text.index("may change")].split())
    assert sorted(re.findall(r"`(\w+)`", sentence)) == sorted(RESUME_MAY_CHANGE)


def test_the_readme_options_are_the_code_s():
    """Every `--option` the README shows exists, and its lists of choices are the real ones."""
    from dbs_mpi.tools import config
    from dbs_mpi.tools.cli import _train_parser
    readme = (ROOT / "README.md").read_text()
    from dbs_mpi.tools.simulator import _parser as simulate_parser
    from dbs_mpi.tools.bench import _parser as bench_parser
    known = {a for parser in (_train_parser(), simulate_parser(), bench_parser()) for action in parser._actions
             for a in action.option_strings} | {"--version"}
    others = {"--kinds", "--ranks", "--repeats", "--strategies", "--variant", "--np", "--base", "--mirror", "--only", "--seeds",
              "--timeout", "--startup",         # scripts/stuck-exit-time.py
              "--durations",                    # pytest's
              "--scale", "--out", "--job",      # scripts and `dbs-mpi bench|data` subcommands
              "--mpi",                          # srun's (srun --mpi=pmi2)
              "--ntasks-per-node", "--gpus-per-node",   # sbatch's
              "--with-mpi"}                     # pytest-mpi's
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", readme))
    assert not shown - known - others, f"README shows options that do not exist: {sorted(shown - known - others)}"
    choices = {"strategy": config.STRATEGIES, "aggregation": config.AGGREGATIONS, "dataset": config.DATASETS,
               "model": config.MODELS, "optimizer": config.OPTIMIZERS}
    main = readme[readme.index("Main options:"):]
    for name, values in choices.items():
        listed = re.search(rf"--{name} \{{([^}}]*)\}}", main)
        assert listed, f"README's main options do not list --{name}'s choices"
        assert tuple(listed.group(1).split(",")) == tuple(values), (name, listed.group(1), values)


@pytest.mark.parametrize("strategy, ranks", [("dbs", 2), ("dbs-sgd", 3)])
def test_every_dataset_and_attribute_a_run_writes_is_in_the_schema(tmp_path, strategy, ranks):
    """And every dataset carries its unit and description."""
    import h5py

    from conftest import run_cli
    from dbs_mpi.training.results import SCHEMA_ATTRIBUTES, SCHEMA_DATASETS
    out = tmp_path / f"{strategy}.h5"
    proc = run_cli(["train", "--strategy", strategy, "--dataset", "synthetic", "--synthetic-samples", "600",
                    "--test-subset", "100", "--epochs", "2", "--global-batch", "60", "--benchmark-steps", "1",
                    "--benchmark-warmup", "0", "--out", str(out)], ranks=ranks, timeout=180)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert set(f.attrs) - set(SCHEMA_ATTRIBUTES) == set(), "attributes missing from the schema"
        datasets = []
        f.visititems(lambda name, obj: datasets.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert set(datasets) - set(SCHEMA_DATASETS) == set(), "datasets missing from the schema"
        for name in datasets:
            assert f[name].attrs["unit"] == SCHEMA_DATASETS[name][1] and f[name].attrs["description"], name


def test_the_readme_stays_a_front_door():
    """About 250 lines: what it is, the commands, your own script, the command line, a
    cluster, results and figures, where each idea lives, tests; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move detail to a page of docs/"
    for page in ("docs/reliability.md", "docs/performance.md", "docs/testing.md"):
        text = (ROOT / page).read_text()
        assert "](../README.md)" in text.split("\n\n")[1], f"{page} does not say what it is for and link back"
