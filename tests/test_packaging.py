"""What `pip install` puts into site-packages: one namespace, `tracekit*` only.

`capture` and `analyze` are unrelated projects on PyPI; a top-level package of that name
would shadow (or be shadowed by) someone else's software. pyproject lists the packages
explicitly (package-dir maps the card's folders into the namespace); this keeps that list
equal to the folders that hold code."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_installed_package_is_under_tracekit():
    packages = _pyproject()["tool"]["setuptools"]["packages"]
    assert packages and all(p == "tracekit" or p.startswith("tracekit.") for p in packages), packages


def test_the_package_list_matches_the_folders():
    """A new subpackage missing from the list would be left out of a wheel silently."""
    setup = _pyproject()["tool"]["setuptools"]
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(setup["packages"])


def test_distribution_name_is_not_the_taken_one():
    """`tracekit` on PyPI is an unrelated project: ours is published as tracekit-llm."""
    assert _pyproject()["project"]["name"] == "tracekit-llm"
    assert _pyproject()["project"]["scripts"] == {"tracekit": "tracekit.cli:main"}
