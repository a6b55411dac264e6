"""The repository cites only what it holds: every path its documents and sources name exists, and
every test they name beside a test file is defined in that file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The repository's own top-level folders, as its texts cite paths in them.
FOLDERS = ("core", "effects", "interpreters", "models", "tests", "bench", "tools", "kvstate", ".ci")
CITED_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(f) for f in FOLDERS)})/[\w./-]*\w)")
#: ``tests/x.py::name``: a test (or class) named in its file.
CITED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
#: ``tests/x.py`` (``name``, ``other``, ...): names of that file's tests, rules or machines.
CITED_NAMES = re.compile(r"`(tests/[\w/]+\.py)` \(([^)]*)\)")
#: Root documents, by the name texts cite them with.
ROOT_DOCUMENTS = ("README.md", "DESIGN.md", "RELIABILITY.md")


def texts() -> dict[Path, str]:
    """Every document and source of the repository but this file (whose examples are not citations), by
    path, with whitespace folded (a citation may wrap across lines)."""
    found = {}
    for folder in ("",) + FOLDERS:
        base = ROOT / folder if folder else ROOT
        paths = base.glob("*.md") if not folder else base.rglob("*")
        for path in paths:
            if (path.is_file() and path.suffix in (".py", ".md", ".txt", ".toml") and "__pycache__" not in path.parts
                    and path != Path(__file__).resolve()):
                found[path] = re.sub(r"\s+", " ", path.read_text(errors="replace"))
    found[ROOT / "pyproject.toml"] = (ROOT / "pyproject.toml").read_text()
    return found


def test_every_cited_path_is_in_the_repository():
    missing = sorted({(path.relative_to(ROOT).as_posix(), cited)
                      for path, text in texts().items()
                      for cited in CITED_PATH.findall(text) if not (ROOT / cited).exists()})
    assert not missing, f"cited but not in the repository (file, citation): {missing}"


def test_every_cited_root_document_exists():
    cited = {name for text in texts().values() for name in ROOT_DOCUMENTS if name in text}
    assert cited, "no text cites the root documents: this check would prove nothing"
    assert all((ROOT / name).is_file() for name in cited)


def test_every_test_named_beside_its_file_is_defined_there():
    wrong, seen = [], 0
    for path, text in texts().items():
        for file, name in CITED_TEST.findall(text):
            seen += 1
            source = (ROOT / file).read_text()
            if not re.search(rf"^\s*(?:def|class) {name}\b", source, re.MULTILINE):
                wrong.append((path.relative_to(ROOT).as_posix(), file, name))
        for file, inside in CITED_NAMES.findall(text):
            source = (ROOT / file).read_text()
            for name in re.findall(r"`(\w+)`", inside):
                seen += 1
                if not re.search(rf"\b{name}\b", source):
                    wrong.append((path.relative_to(ROOT).as_posix(), file, name))
    assert seen > 10, "too few cited tests found: the patterns no longer match how the texts cite them"
    assert not wrong, f"named beside a test file that does not define it (file, test file, name): {wrong}"


def test_nothing_cites_a_path_outside_the_repository():
    outside = sorted({path.relative_to(ROOT).as_posix() for path, text in texts().items()
                      if re.search(r"\.\./\w", text) and path.suffix == ".md"})
    assert not outside, f"documents that cite a path outside the repository: {outside}"
