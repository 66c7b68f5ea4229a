"""Builds the custom-op library as part of ``pip install [-e] .`` (metadata: pyproject.toml).

The library needs TensorFlow's headers at build time, so install with
``--no-build-isolation`` into an environment that has TensorFlow (``make setup`` does).
Without TensorFlow the install still succeeds and tfhybrid uses its pure-TF paths until
``python -m tfhybrid.custom_ops.build`` is run.
"""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithOps(build_py):
    def run(self):
        result = subprocess.run([sys.executable, "-m", "tfhybrid.custom_ops.build"], cwd=ROOT)
        if result.returncode != 0:
            print("tfhybrid: the custom-op library was not built (is TensorFlow installed "
                  "here? use --no-build-isolation); the pure-TF paths will be used",
                  file=sys.stderr)
        super().run()


setup(cmdclass={"build_py": BuildPyWithOps})
