"""The user documentation points only at what exists: README.md, docs/ and the folder READMEs.

Static checks: every relative link resolves to a file or folder of the checkout, README.md links
nowhere outside the repository and stays within 250 lines, and every repository path a page names
in backquotes (scripts/..., tests/..., examples/..., launch/..., docs/...) exists.
"""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "scripts/README.md", "launch/README.md"]
               + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)])
PAGES = [p for p in PAGES if os.path.isfile(os.path.join(ROOT, p))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"`((?:scripts|tests|examples|launch|docs)/[A-Za-z0-9_./-]+)`")


def _text(page):
    return open(os.path.join(ROOT, page), encoding="utf-8").read()


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(_text(page)):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
        if not os.path.exists(path):
            broken.append(target)
    assert not broken, f"{page}: links to nothing in the checkout: {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_named_paths_exist(page):
    missing = [p for p in _PATH.findall(_text(page)) if not os.path.exists(os.path.join(ROOT, p.rstrip(".")))]
    assert not missing, f"{page}: names paths that do not exist: {missing}"


def test_readme_is_short_and_links_only_inside_the_repository():
    text = _text("README.md")
    assert len(text.splitlines()) <= 250, f"README.md has {len(text.splitlines())} lines; keep it <= 250 (detail goes to docs/)"
    outside = [t for t in _LINK.findall(text) if "://" in t]
    assert not outside, f"README.md links outside the repository: {outside}"
