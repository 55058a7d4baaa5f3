"""The package list, derived from the tree: every folder with an ``__init__.py`` under each root
``pyproject.toml``'s ``[tool.setuptools.package-dir]`` maps (``tiers/peer`` is
``statetier.tiers.peer``). Everything else about the build is in pyproject.toml; setuptools'
own discovery cannot prefix a mapped folder's subpackages with the package it is mapped to,
so a hand-written list was the alternative, and it forgot ``statetier.tiers.peer`` once.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def mapped_packages() -> list[str]:
    mapping = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = []
    for name, folder in mapping.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(where=str(HERE / folder)))]
    return sorted(packages)


setup(packages=mapped_packages())
