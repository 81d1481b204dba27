"""The repository is self-contained: every relative link in its Markdown resolves to a
file inside it (and, for a link to a heading, to a heading of that file), and nothing
refers to files outside the repository."""
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
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path):
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


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
