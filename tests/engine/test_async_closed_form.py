"""The closed forms a fast path for async and overlapped replicas would use (issue 48; the
design in bench/README.md) still describe the stepped engine bit for bit:
`tools/async_stretch_check.py` predicts every would-be stretch from what its first plan reads
and compares it with the log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("args", [["--scheduler", "vllm_v1"],
                                  ["--scheduler", "sglang", "--noise", "0.2"],
                                  ["--num-blocks", "400", "--qps", "8"]],
                         ids=["vllm_v1", "sglang-noise", "tight-kv"])
def test_async_stretches_are_closed_form(args):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "async_stretch_check.py"),
                           "--num-requests", "300", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 mismatches" in proc.stdout
