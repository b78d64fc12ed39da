"""`servesim simulate` and its result directory: checked before the run, written whole or not at
all, an earlier run replaced whole, Ctrl-C exits 130 and keeps the previous results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers import assert_one_line_error, read_until, run_cli, sigint_default
from tests.helpers import run_cli_out as cli

SMALL = """\
name: small
record_token_times: {tokens}
workload:
  format: synthetic
  num_requests: {n}
  arrivals: {{qps: {qps}}}
  lengths:
    prompt: {{dist: uniform, low: 10, high: 900}}
    output: {{dist: uniform, low: 1, high: 50}}
"""


def scenario(tmp_path: Path, *, n: int = 50, qps: float = 4.0, tokens: bool = False) -> Path:
    path = tmp_path / f"s{n}_{qps}_{tokens}.yaml"
    path.write_text(SMALL.format(n=n, qps=qps, tokens=str(tokens).lower()))
    return path


def test_out_that_is_a_file_fails_before_running(tmp_path, monkeypatch, capsys):
    target = tmp_path / "taken"
    target.write_text("not a directory")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path)), "--out",
                        str(target))
    assert_one_line_error(code, err, "--out", "not a directory")
    assert target.read_text() == "not a directory"


def test_out_that_holds_other_files_is_never_replaced(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path)), "--out",
                        str(mine))
    assert_one_line_error(code, err, "--out", "not an earlier run")
    assert (mine / "notes.txt").read_text() == "keep me"


def test_out_below_a_file_is_an_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path)), "--out",
                        str(tmp_path / "file" / "run"))
    assert_one_line_error(code, err, "--out", "is a file")


def test_negative_seed_is_an_error(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path)), "--seed", "-1")
    assert code == 2 and "Traceback" not in err and "--seed" in err


def test_an_earlier_run_is_replaced_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, _ = cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path, tokens=True)),
                  "--out", str(out))
    assert code == 0 and (out / "tokens.parquet").is_file()
    code, _ = cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path, n=60)),
                  "--out", str(out))
    assert code == 0
    # No stale tokens.parquet of the first run beside the second run's files.
    names = {p.name for p in out.iterdir()}
    assert "tokens.parquet" not in names
    assert {"iterations.parquet", "requests.parquet", "scenario.yaml", "summary.json"} <= names
    assert len(pd.read_parquet(out / "requests.parquet")) == 60
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_earlier_run_holding_a_nested_run_or_notes_is_never_replaced(tmp_path, monkeypatch,
                                                                      capsys):
    # A run replaced whole deleted a run nested in its directory (out_int/inner), exit 0.
    out, path = tmp_path / "out_int", str(scenario(tmp_path))
    assert cli(monkeypatch, capsys, "simulate", path, "--out", str(out))[0] == 0
    assert cli(monkeypatch, capsys, "simulate", path, "--out", str(out / "inner"))[0] == 0
    mtime = (out / "summary.json").stat().st_mtime_ns
    code, err = run_cli(monkeypatch, capsys, "simulate", path, "--out", str(out))
    assert_one_line_error(code, err, "--out", "holds 'inner', which no run writes",
                          "replacing the earlier run would delete it")
    assert (out / "inner" / "summary.json").is_file()
    assert (out / "summary.json").stat().st_mtime_ns == mtime  # refused before running
    (out / "inner").rename(tmp_path / "inner")
    (out / "notes.txt").write_text("keep me")
    code, err = run_cli(monkeypatch, capsys, "simulate", path, "--out", str(out),
                        "--replications", "2", "--workers", "1")
    assert_one_line_error(code, err, "holds 'notes.txt'")
    assert (out / "notes.txt").read_text() == "keep me"


def test_an_earlier_run_with_what_servesim_writes_there_is_replaced(tmp_path, monkeypatch,
                                                                    capsys):
    from sim.export import DEFAULT_FILES
    from sim.results.outdir import EXPORT_FILES, REPORT_FILE

    assert set(DEFAULT_FILES.values()) == EXPORT_FILES
    out, path = tmp_path / "run", str(scenario(tmp_path))
    assert cli(monkeypatch, capsys, "simulate", path, "--out", str(out))[0] == 0
    (out / "plots").mkdir()
    (out / "plots" / "cdf.png").write_bytes(b"")
    for name in (REPORT_FILE, *EXPORT_FILES, ".summary.json.ab12.tmp"):
        (out / name).write_text("")
    assert cli(monkeypatch, capsys, "simulate", path, "--out", str(out))[0] == 0
    assert not (out / "plots").exists() and not (out / REPORT_FILE).exists()


def test_overloaded_run_says_so(tmp_path, monkeypatch, capsys):
    """A replica at many times its capacity: the table is followed by the verdict."""
    monkeypatch.setenv("COLUMNS", "200")
    path = scenario(tmp_path, n=400, qps=400.0)
    code, out = cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert code == 0
    assert "OVERLOADED" in out
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["overload"]["verdict"] == "overloaded"


@pytest.mark.slow
def test_interrupt_keeps_the_previous_run_and_exits_130(tmp_path):
    """SIGINT while a long run simulates: exit 130, the earlier run's files untouched, no
    temporary directory left behind."""
    out = tmp_path / "run"
    servesim = [sys.executable, "-m", "sim"]
    first = subprocess.run([*servesim, "simulate", str(scenario(tmp_path)), "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    long_run = scenario(tmp_path, n=600_000, qps=5.0)  # about a minute to simulate
    proc = subprocess.Popen([*servesim, "simulate", str(long_run), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    assert proc.stderr is not None
    # Interrupted mid-simulation, as its first progress line (after 10 s when not on a
    # terminal) shows: a fixed wait after the start failed on a busy machine, where the
    # process was still starting.
    seen = read_until(proc.stderr, r"simulating small: progress \d+/600000 arrivals")
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen, stdout, stderr)
    assert "interrupted" in stdout + stderr and "Traceback" not in stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_json_prints_only_the_summary_on_stdout(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    monkeypatch.setattr(sys, "argv", ["servesim", "simulate", str(scenario(tmp_path)), "--out",
                                      str(out), "--json"])
    from sim.cli import main

    main()
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # stdout is the JSON document, nothing else
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["requests"]["total"] == 50
    assert "results: " in captured.err  # the notes went to stderr
    assert (out / "requests.parquet").is_file() and (out / "scenario.yaml").is_file()


def test_json_with_replications_prints_their_estimates(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    monkeypatch.setattr(sys, "argv", ["servesim", "simulate", str(scenario(tmp_path)), "--out",
                                      str(out), "--json", "--replications", "2",
                                      "--workers", "1"])
    from sim.cli import main

    main()
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data == json.loads((out / "replications.json").read_text())
    assert data["replications"] == 2


def test_result_directories_follow_the_umask(tmp_path):
    """A run's directory gets the mode a plain mkdir would (0755 under umask 022), not the
    0700 of the temporary directory it was filled in: teammates read results on a shared disk."""
    import os

    from sim.results.outdir import write_dir

    old = os.umask(0o022)
    try:
        out = write_dir(tmp_path / "run", lambda tmp: (tmp / "summary.json").write_text("{}"))
        assert out.stat().st_mode & 0o777 == 0o755
        os.umask(0o027)
        out = write_dir(tmp_path / "run2", lambda tmp: None)
        assert out.stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(old)


def test_ctrl_c_after_the_run_is_written_says_the_results_are_whole(tmp_path, monkeypatch,
                                                                    capsys):
    """A Ctrl-C while the tables print (the results already swapped in) exited 130 with only
    "interrupted", as if nothing were kept."""
    import sim.cli.run

    def interrupted(summary):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(sim.cli.run, "summary_table", interrupted)
    out = tmp_path / "run"
    code, printed = cli(monkeypatch, capsys, "simulate", "--set", "workload.num_requests=20",
                        "--out", str(out))
    assert code == 130 and (out / "summary.json").is_file()
    assert "interrupted after the run was complete" in " ".join(printed.split())


def test_a_run_cleans_what_a_killed_run_left_beside_its_directory(tmp_path, monkeypatch,
                                                                   capsys):
    """A run killed while writing (SIGKILL: nothing of it runs again) leaves its temporary
    siblings, named with its process id; the next run to the same place removes them, and
    leaves those of a live process and of other directories alone."""
    from sim.results.outdir import temporary_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = [tmp_path / f".run.tmp-{dead}-ab12", tmp_path / f".run.old-{dead}-cd34" / "run"]
    for path in left:
        path.mkdir(parents=True)
        (path / "summary.json").write_text("{}")
    kept = [tmp_path / f".run.tmp-{os.getpid()}-live", tmp_path / f".other.tmp-{dead}-ef56",
            tmp_path / ".run.tmp-noid"]
    for path in kept:
        path.mkdir()
    code, _ = cli(monkeypatch, capsys, "simulate", str(scenario(tmp_path)), "--out",
                  str(tmp_path / "run"))
    assert code == 0
    assert not (tmp_path / f".run.tmp-{dead}-ab12").exists()
    assert not (tmp_path / f".run.old-{dead}-cd34").exists()
    assert all(path.is_dir() for path in kept)
    # This process's own temporaries carry its id, for the next run to judge.
    tmp = temporary_dir(tmp_path / "run")
    assert tmp.name.startswith(f".run.tmp-{os.getpid()}-")
