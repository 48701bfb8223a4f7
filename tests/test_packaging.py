"""The package's metadata: no setuptools deprecation banner at install, a description of what it is."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_pyproject_uses_an_spdx_license_and_a_setuptools_that_reads_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"  # the table form is deprecated (setuptools banner)
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read an SPDX string
    description = project["project"]["description"]
    assert description.startswith("KV-cache compression by merging tokens") and "vLLM" in description
    assert "runs/" in (ROOT / ".gitignore").read_text().splitlines()
