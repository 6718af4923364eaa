"""Install the repository's top-level folders under the one import name ``gradscope``.

``trainers/``, ``analyses/`` and ``figures/`` stay where they are in the repository (DESIGN.md's
architecture) but install as ``gradscope.trainers``, ``gradscope.analyses`` and ``gradscope.figures``, so a
user's own ``figures.py`` can never shadow them. Everything else is in pyproject.toml.
"""
from setuptools import find_packages, setup

MAPPED = ("trainers", "analyses", "figures")

packages = find_packages(include=["gradscope", "gradscope.*"])
for folder in MAPPED:
    packages += [f"gradscope.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages,
      package_dir={"gradscope": "gradscope", **{f"gradscope.{folder}": folder for folder in MAPPED}})
