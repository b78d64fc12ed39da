"""The docs site builds without a warning (`mkdocs build --strict`: broken links and anchors
fail), and the README and DEVELOPERS.md stay short enough to read."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

ROOT = REPO


def test_the_docs_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_front_pages_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len((ROOT / "DEVELOPERS.md").read_text().splitlines()) <= 200
