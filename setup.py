"""Packaging of the one import name `moetune`: the repository's top-level folders are its subpackages
(`api/` -> moetune.api, `service/` -> moetune.service, ...). Everything else lives in pyproject.toml."""

from setuptools import find_namespace_packages, setup

FOLDERS = ("api", "service", "workers", "kernels")

setup(
    packages=[f"moetune.{p}" for p in find_namespace_packages(include=[f"{f}*" for f in FOLDERS],
                                                              exclude=["*__pycache__*"])],
    package_dir={f"moetune.{f}": f for f in FOLDERS},
)
