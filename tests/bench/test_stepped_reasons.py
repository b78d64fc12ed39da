"""`bench/stepped_reasons.py` counts why plans are stepped on `cluster_scaling.py`'s case: every
stepped plan gets one reason and one kind (a continuation, a decision or after a stretch)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO

BENCH = REPO / "bench" / "stepped_reasons.py"


def test_every_stepped_plan_is_counted_once_in_each_table():
    out = subprocess.run([sys.executable, str(BENCH), "--num-requests", "300", "--replicas", "2"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    why, kind = (dict((name, int(n.replace(",", ""))) for n, name in
                      re.findall(r"^\s+([\d,]+)\s+(.+)$", table, re.M))
                 for table in out.split("\n\n")[1:3])
    assert why.pop("(a stretch)") > 0
    assert sum(why.values()) == sum(kind.values()) > 0
