"""The documentation stays inside the repository (docs/testing.md, section 4).

Someone who clones only this repository must be able to follow every reference in it, so:

- no comment, docstring or message in src/, tests/ or benchmarks/, and no line of README.md or docs/*.md, cites
  a design document that is not in the repository (the project's notes SPEC / DESIGN / REFERENCE_SEMANTICS, the
  paper notes by seed number, or the folder of golden vectors beside the checkout) -- they say the thing
  themselves or cite docs/;
- every relative link of README.md and docs/*.md resolves to a file of the repository (and heading, for an anchor);
- every ``docs/<page>.md`` the code cites exists, and every "Decision X1" it cites is a heading of docs/semantics.md.

Only prose is checked in Python files: comments and string constants (docstrings, messages, help texts). Code
is not prose: tests/conftest.py finds the golden folder through VITLAB_SHARED with plain path code, and a
one-word string is a name or an argparse metavar (``metavar=("SPEC", "OUT")``), not a citation.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("src", "tests", "benchmarks")
THIS = Path(__file__).resolve()  # states the forbidden names in order to forbid them

# Case-sensitive: the outside documents were always cited by these exact spellings.
OUTSIDE = re.compile(
    r"\b(?:SPEC|DESIGN|REFERENCE_SEMANTICS)(?:\.md)?\b"  # SPEC.md, "SPEC §5.1", "SPEC Decision 4", DESIGN.md
    r"|\.\./shared\b"  # ../shared/golden
    r"|\bshared/(?:golden|data|seeds)\b"  # shared/golden/aft_*.npz
    r"|\bgolden/README\b"  # the golden folder's own README
    r"|\b[Ss]eeds?[ /]0\d\d\b"  # "seed 000 Table 2": the paper notes by number
)
DOC_CITATION = re.compile(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?")
DECISION_CITATION = re.compile(r"\bdocs/semantics\.md,?\s+Decisions?\s+([A-Z]\d+(?:/[A-Z]\d+)*)")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def python_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if p.resolve() != THIS)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string constant of a Python file; one-word strings left out."""
    source = path.read_text(encoding="utf-8")
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not node.value.isidentifier():
            out.append((node.lineno, node.value))
    return out


def markdown_lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for _, line in markdown_lines(path):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} +(.*)", line)):
            out.add(slug(m[1]))
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_scan_sees_files_and_the_patterns_match_what_they_must():
    assert len(python_files()) > 50 and (ROOT / "docs" / "semantics.md").exists()
    for cited in ("SPEC Decision 4", "SPEC §5.1", "see SPEC.md", "DESIGN.md", "REFERENCE_SEMANTICS", "seed 000 Fig. 2"):
        assert OUTSIDE.search(cited), cited
    for cited in ("(`../shared/golden/`)", "shared/golden/aft_*.npz", "see golden/README.md", "Seed 001, eq. 9.1"):
        assert OUTSIDE.search(cited), cited
    for fine in ("SPEC_GMACS", "spec", "Specification", "$VITLAB_SHARED/golden", "the shared folder", "seed 0"):
        assert not OUTSIDE.search(fine), fine


@pytest.mark.parametrize("path", python_files(), ids=rel)
def test_code_prose_cites_nothing_outside_the_repository(path):
    hits = [f"{rel(path)}:{line}: {m[0]!r}" for line, text in prose(path) if (m := OUTSIDE.search(text))]
    assert not hits, "cite docs/ (or say it) instead of documents outside the repository:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_markdown_cites_nothing_outside_the_repository(path):
    hits = [f"{rel(path)}:{n}: {m[0]!r}" for n, line in markdown_lines(path) if (m := OUTSIDE.search(line))]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_markdown_links_resolve(path):
    bad = []
    for n, line in markdown_lines(path):
        for target in MD_LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.is_relative_to(ROOT) or not dest.exists():
                bad.append(f"{rel(path)}:{n}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(path)}:{n}: {target} (no heading with that anchor)")
    assert not bad, "\n".join(bad)


def test_docs_and_decisions_cited_by_the_code_exist():
    semantics = (ROOT / "docs" / "semantics.md").read_text(encoding="utf-8")
    decisions = set(re.findall(r"^#+ Decision ([A-Z]\d+):", semantics, re.MULTILINE))
    assert {"R1", "D1", "C1", "T2", "E1", "A3"} <= decisions
    bad = []
    for path in python_files():
        for line, text in prose(path):
            for page, anchor in DOC_CITATION.findall(text):
                dest = ROOT / "docs" / page
                if not dest.exists() or (anchor and anchor not in anchors(dest)):
                    bad.append(f"{rel(path)}:{line}: docs/{page}{'#' + anchor if anchor else ''}")
            for group in DECISION_CITATION.findall(text):
                bad += [f"{rel(path)}:{line}: Decision {d}" for d in group.split("/") if d not in decisions]
    assert not bad, "cited but not in docs/:\n" + "\n".join(bad)


# a dotted module path (`vitlab.engine.loop`, `vitlab.ops.double_norm._DoubleNormalize`) or a source path
# (`src/vitlab/distill/safety.py`) as prose cites it
MODULE_CITATION = re.compile(r"(?<![\w/.-])vitlab(?:\.\w+)+")
PATH_CITATION = re.compile(r"(?<![\w/.-])(?:src/)?vitlab/[\w/]+\.py\b")
OLD_TOP_LEVEL = ("train", "seg", "points", "lm", "convert", "integrations", "pretrained", "catalog", "data_cli",
                 "convert_cli", "export", "io", "runtime", "registry", "options", "extras", "device",
                 "distributed", "rundir", "report", "tracking", "optim", "cli")  # fmt: skip


def package_modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "src" / "vitlab").rglob("*.py"):
        parts = p.relative_to(ROOT / "src").with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


@functools.cache
def source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def stale_citations(text: str, mods: dict[str, Path]) -> list[str]:
    """The module paths and source files ``text`` cites that the package does not have: a dotted name whose
    longest module prefix is missing or lacks the next name, a ``vitlab/...py`` path that is no file. A name whose
    second part is neither a package of today nor one of before (``vitlab.refiner_vit_s``, timm's name for a
    model) is no module path."""
    tops = {name.split(".")[1] for name in mods if "." in name} | set(OLD_TOP_LEVEL)
    bad = []
    for m in MODULE_CITATION.finditer(text):
        parts = m[0].split(".")
        if parts[1] not in tops:
            continue
        k = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods), default=1)
        if k == 1 or (
            k < len(parts) and not re.search(rf"\b{re.escape(parts[k])}\b", source(mods[".".join(parts[:k])]))
        ):
            bad.append(m[0])
    for m in PATH_CITATION.finditer(text):
        if not (ROOT / (m[0] if m[0].startswith("src/") else f"src/{m[0]}")).is_file():
            bad.append(m[0])
    return bad


def test_the_stale_path_finder_finds_old_paths():
    mods = package_modules()
    assert stale_citations("see vitlab.train.compare and src/vitlab/train/compare.py", mods) == [
        "vitlab.train.compare",
        "src/vitlab/train/compare.py",
    ]
    assert stale_citations("vitlab.engine.loop.train_one_epoch_that_is_not_there", mods)
    assert not stale_citations("vitlab.engine.loop, vitlab.ops.double_norm._DoubleNormalize, vitlab.refiner_vit_s,"
                               " src/vitlab/distill/safety.py", mods)  # fmt: skip


OLD_PATH_TEST = ROOT / "tests" / "test_old_import_paths.py"  # imports the old paths on purpose


@pytest.mark.parametrize("path", [*markdown_files(), *(p for p in python_files() if p != OLD_PATH_TEST)], ids=rel)
def test_docs_and_code_cite_the_modules_of_today(path):
    """README, docs/ and the code's prose name modules and files where they are now (the old import paths only
    where a line says they are deprecated, or in a section headed "Old import paths")."""
    mods = package_modules()
    lines = markdown_lines(path) if path.suffix == ".md" else prose(path)
    if path.suffix == ".md":  # a section headed "Old import paths" lists them on purpose
        section, kept = "", []
        for n, text in lines:
            section = text if text.startswith("#") else section
            kept += [] if "old import paths" in section.lower() else [(n, text)]
        lines = kept
    bad = [f"{rel(path)}:{n}: {b}" for n, text in lines if "deprecated" not in text.lower()
           for b in stale_citations(text, mods)]  # fmt: skip
    assert not bad, "stale module paths:\n" + "\n".join(bad)
