"""The list of mutants explained as equivalent (``tools/equivalent_mutants.txt``) names sites that exist:
an edit that moves a line moves its site, and an explanation left on the old line would hide nothing
and explain a mutant nobody runs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import mutants  # noqa: E402


def test_every_explained_mutant_names_a_site_of_its_file_as_it_is_now():
    explained = mutants.explanations()
    assert explained, "tools/equivalent_mutants.txt lists no explained mutant"
    files = {name.split(":")[0] for name in explained}
    known = {site["name"] for path in files for site in mutants.sites(ROOT / path)}
    gone = sorted(name for name in explained if name not in known)
    assert not gone, f"explained mutants whose sites moved or went (remap them to their lines): {gone}"
    assert all(reason for reason in explained.values()), "every explained mutant says why it is equivalent"
