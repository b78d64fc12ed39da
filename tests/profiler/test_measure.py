"""The profiler on the CPU: a tiny model measured, fitted and checked for real (torch, no mocks)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the profiler needs torch (pip install -e .[profile])")

from profiler.fit.fitting import errors, fit_profile  # noqa: E402
from profiler.measure.mixes import Chunk, GridSpec, Mix, grid, random_mixes  # noqa: E402
from profiler.measure.model import Decoder, SeqInput  # noqa: E402
from profiler.measure.timing import load  # noqa: E402
from sim.cli import main  # noqa: E402
from sim.hardware.models import MODELS  # noqa: E402
from tests.helpers import sigint_default  # noqa: E402


def cli(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["servesim", *args])
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_chunked_forward_equals_whole_prompt_and_reads_the_cache():
    """A prompt computed in two chunks (the second attending to the first's KV, RoPE at the true
    positions) gives the same logits as computed whole; a decode beside a chunk too."""
    torch.manual_seed(0)
    model = Decoder(MODELS.get("tiny"), 4096)
    ids = torch.randint(0, 4096, (100,))
    whole = model.forward([SeqInput(0, 0, ids, True)])
    assert model.forward([SeqInput(1000, 0, ids[:60], False)]).numel() == 0  # no logits mid-prompt
    second = model.forward([SeqInput(1000, 60, ids[60:], True)])
    assert torch.allclose(whole, second, atol=1e-5)
    nxt = torch.tensor([int(whole.argmax())])
    alone = model.forward([SeqInput(0, 100, nxt, True)])
    mixed = model.forward([SeqInput(3000, 0, ids[:7], True), SeqInput(1000, 100, nxt, True)])
    assert torch.allclose(alone, mixed[1:], atol=1e-5)


def test_mix_features_match_the_simulator_shape():
    mix = Mix((Chunk(64, 128, samples=False), Chunk(40)), (99, 9))
    shape = mix.shape()
    assert (shape.num_prefill_tokens, shape.num_decode_tokens, mix.num_tokens) == (104, 2, 106)
    assert shape.num_sampled_tokens == 3
    assert shape.prefill_attn_pairs == 64 * 128 + 64 * 65 // 2 + 40 * 41 // 2
    assert shape.decode_kv_tokens == 100 + 10
    assert Mix.from_json(mix.to_json()) == Mix(mix.chunks, mix.decode_contexts)


def test_grid_covers_what_matters():
    spec = GridSpec(max_tokens=8192, max_context=32768, max_batch=256, max_kv_tokens=2_000_000)
    mixes = grid(spec, np.random.default_rng(0))
    tokens = {m.num_tokens for m in mixes if m.tag == "tokens"}
    assert {128, 129, 256, 257, 8192} <= tokens  # both sides of tile boundaries
    assert max(m.max_context for m in mixes) >= 32768
    skewed = [m for m in mixes if m.tag == "decode_skewed" and len(m.decode_contexts) == 256]
    assert skewed and all(np.std(m.decode_contexts) > 0 for m in skewed)
    held = random_mixes(spec, 50, np.random.default_rng(1))
    assert all(0 < m.num_tokens <= 8192 for m in held)
    assert not {m.key for m in held} & {m.key for m in mixes}


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """Profile and fit the tiny model on this CPU, through the CLI, as a user would."""
    out = tmp_path_factory.mktemp("profile") / "tiny.parquet"
    mp = pytest.MonkeyPatch()
    try:
        code = cli(mp, "profile", "--model", "tiny", "--device", "cpu", "--out", str(out),
                   "--holdout", "60", "--reps", "5", "--warmup", "1", "--max-context", "2048")
        assert code == 0
        assert cli(mp, "fit", str(out)) == 0
    finally:
        mp.undo()
    return out, out.with_suffix(".json")


@pytest.mark.slow
def test_profile_records_its_measurement_conditions(tiny_profile):
    df, meta = load(tiny_profile[0])
    for key in ("device_name", "torch", "dtype", "attention_backend", "model_shape", "date",
                "command", "grid"):
        assert meta.get(key), key
    assert meta["model"] == "tiny" and "servesim profile" in meta["command"]
    assert (df["split"] == "holdout").sum() == 60
    assert (df["min_s"] <= df["median_s"]).all() and (df["median_s"] <= df["max_s"]).all()
    assert df["samples_s"].map(len).eq(5).all()


def remeasured_spread(profile_path, num: int = 30) -> float:
    """Time `num` held-out mixes of the profile again, now, with the profile's settings; return
    the mean |again - first| / first. This is the noise no model can beat on this machine in
    this run, including the drift since the profile was measured (neighbours' load, clocks)."""
    from profiler.measure.timing import Timer, measure_mix

    df, meta = load(profile_path)
    rows = df[df["split"] == "holdout"].head(num)
    decoder = Decoder(MODELS.get(meta["model"]), meta["grid"]["max_kv_tokens"])
    rng = np.random.default_rng(7)
    again = np.array([np.median(measure_mix(decoder, Mix.from_json(key), Timer("cpu"),
                                            meta["warmup"], meta["reps"], rng))
                      for key in rows["key"]])
    first = rows["median_s"].to_numpy()
    return float(np.mean(np.abs(again - first) / first))


@pytest.mark.slow
def test_fitted_model_error_on_held_out_mixes(tiny_profile):
    """On a quiet machine the fitted model reaches 9-11% MAPE on held-out mixes (timing noise
    P95 ~10%), so 20% is the bound. On a loaded one (other jobs sharing the cores), timings
    drift by tens of percent between measurements minutes apart and no model can do better
    than that: the bound becomes 12% (the model's own error) plus the larger of the spread of
    the same mixes timed twice in this run and the repeats' own P95 spread while the profile
    was measured (the load may have eased by the time they are timed again: seen, two test
    suites sharing the two cores). A model missing a term (attention, per-request cost) lands
    far above either (see the next test)."""
    fitted = json.loads(tiny_profile[1].read_text())
    assert fitted["holdout"]["n"] == 60
    assert all(v >= 0 for v in fitted["coef"].values())
    if fitted["holdout"]["mape"] <= 0.20:
        return
    spread = remeasured_spread(tiny_profile[0])
    noise = (fitted.get("noise") or {}).get("p95_rel_abs_dev", 0.0)
    bound = max(0.20, 0.12 + max(spread, noise))
    assert fitted["holdout"]["mape"] <= bound, (fitted["holdout"], fitted["noise"], spread)


@pytest.mark.slow
def test_fit_is_what_a_model_without_attention_terms_cannot_match(tiny_profile):
    """On a quiet machine the fit beats a model without its terms by more than 2x. On a loaded
    one (seen: other jobs on both cores gave held-out MAPE 48% for the fit and 55% for the blind
    model) the timings themselves drift by tens of percent and no comparison means anything:
    then the test says so and skips, after timing the same mixes again to show the drift."""
    df, meta = load(tiny_profile[0])
    fitted = fit_profile(df, meta)
    blind = {**fitted, "coef": dict.fromkeys(fitted["coef"], 0.0)}
    holdout = df[df["split"] == "holdout"]
    fit_mape, blind_mape = errors(fitted, holdout)["mape"], errors(blind, holdout)["mape"]
    if fit_mape > 0.20:
        spread = remeasured_spread(tiny_profile[0])
        if spread > 0.10:
            pytest.skip(f"machine too loaded to compare models: held-out MAPE {fit_mape:.0%} "
                        f"(quiet: 9-11%), the same mixes timed again differ by {spread:.0%}")
    assert blind_mape > 2 * fit_mape, (fit_mape, blind_mape)


@pytest.mark.slow
def test_resume_keeps_measurements(tiny_profile, monkeypatch, tmp_path):
    out = tmp_path / "again.parquet"
    out.write_bytes(tiny_profile[0].read_bytes())
    before, _ = load(out)
    assert cli(monkeypatch, "profile", "--model", "tiny", "--out", str(out), "--holdout", "62",
               "--reps", "5", "--warmup", "1", "--max-context", "2048") == 0
    after, meta = load(out)
    assert len(after) == len(before) + 2  # only the two new held-out mixes were measured
    assert after["key"].iloc[: len(before)].tolist() == before["key"].tolist()
    # The record keeps when its rows were first measured (a resumption said: all today).
    first = load(tiny_profile[0])[1]
    assert (meta["date"], meta["command"]) == (first["date"], first["command"])
    assert [r["num_rows_before"] for r in meta["resumed"]] == [len(before)]
    assert "--holdout 62" in meta["resumed"][0]["command"]


@pytest.mark.slow
def test_resuming_a_complete_profile_leaves_it_as_it_was(tiny_profile, monkeypatch, tmp_path):
    """The README's command on the committed profile measured nothing and still rewrote it
    (`git status`: modified), its record now of another date."""
    out = tmp_path / "same.parquet"
    out.write_bytes(tiny_profile[0].read_bytes())
    assert cli(monkeypatch, "profile", "--model", "tiny", "--out", str(out), "--holdout", "60",
               "--reps", "5", "--warmup", "1", "--max-context", "2048") == 0
    assert out.read_bytes() == tiny_profile[0].read_bytes()


@pytest.mark.slow
def test_check_measures_fresh_mixes_and_plots(tiny_profile, monkeypatch, tmp_path):
    plot = tmp_path / "check.png"
    assert cli(monkeypatch, "profile", "--check", str(tiny_profile[1]), "--num", "12",
               "--plot", str(plot)) == 0
    assert plot.stat().st_size > 10_000


@pytest.mark.slow
def test_check_says_when_it_is_worse_than_recorded(tiny_profile, monkeypatch, capsys,
                                                   tmp_path):
    """A check far worse than the fit's held-out error (37.7% against 9.7% on a loaded VM)
    means the profile no longer describes this machine: said, not left to the table."""
    fitted = json.loads(tiny_profile[1].read_text())
    fitted["holdout"]["mape"] = 1e-4  # no real check gets within twice this
    claimed = tmp_path / "claimed.json"
    claimed.write_text(json.dumps(fitted))
    assert cli(monkeypatch, "profile", "--check", str(claimed), "--num", "6") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "WORSE THAN RECORDED" in out and "against 0.0% when fitted" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("option,value,key", [("--max-context", "4096", "grid.max_context"),
                                              ("--reps", "3", "reps"),
                                              # was resumed: rows of 1 and 2 threads, recorded
                                              # as measured with 2
                                              ("--threads", "2", "torch_threads")])
def test_a_profile_is_resumed_only_under_its_own_conditions(tiny_profile, monkeypatch, capsys,
                                                           tmp_path, option, value, key):
    """Resuming with another grid or repetitions would add rows measured otherwise under the
    profile's one record (the README's command, without --max-context 2048, grew the committed
    profile by 249 mixes of a 4096-token grid and relabelled all 543): one line, exit 2,
    nothing measured."""
    out = tmp_path / "p.parquet"
    out.write_bytes(tiny_profile[0].read_bytes())
    args = {"--holdout": "60", "--reps": "5", "--warmup": "1", "--max-context": "2048",
            option: value}
    assert cli(monkeypatch, "profile", "--model", "tiny", "--out", str(out),
               *[x for pair in args.items() for x in pair]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"p.parquet: {key}=" in err and option in err, err
    assert out.read_bytes() == tiny_profile[0].read_bytes()


@pytest.mark.slow
def test_profile_of_another_model_is_not_resumed(tiny_profile, monkeypatch, capsys, tmp_path):
    out = tmp_path / "p.parquet"
    out.write_bytes(tiny_profile[0].read_bytes())
    assert cli(monkeypatch, "profile", "--model", "llama-2-7b", "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "p.parquet: model='tiny'" in err


def test_varlen_backend_builds_the_right_paged_batch():
    """The varlen path (CUDA's paged FlashAttention) builds cumulative lengths and block tables;
    with the SDPA-based stand-in for the kernel it must give the reference path's logits."""
    from profiler.measure.model import reference_varlen
    from profiler.measure.timing import inputs_for

    shape = MODELS.get("tiny")
    sdpa = Decoder(shape, 8192, seed=3)
    varlen = Decoder(shape, 8192, seed=3, attention="varlen", varlen_fn=reference_varlen)
    mix = Mix((Chunk(37, 100), Chunk(20, 0, samples=False)), (5, 300, 16))
    seqs = inputs_for(mix, shape.vocab_size, 8192, np.random.default_rng(0), block_size=16)
    assert all(x.kv_offset % 16 == 0 for x in seqs)
    expected = sdpa.forward(seqs)
    got = varlen.forward(seqs)
    assert got.shape == expected.shape == (4, shape.vocab_size)  # no row for the mid chunk
    assert torch.allclose(got, expected, atol=1e-5)
    meta = varlen._varlen_metadata(seqs)
    assert meta["cu_seq_q"].tolist() == [0, 37, 57, 58, 59, 60]
    assert meta["seqused_k"].tolist() == [137, 20, 6, 301, 17]


@pytest.mark.slow
def test_the_check_plot_is_checked_before_measuring(tiny_profile, monkeypatch, capsys,
                                                    tmp_path):
    """`--plot DIR` was saved as DIR.png and reported as DIR; `--plot x.txt` failed in
    matplotlib's traceback after the mixes were measured."""
    plot_dir = tmp_path / "plots"
    plot_dir.mkdir()
    for plot, needles in ((plot_dir, ["--plot=", "is a directory"]),
                          (tmp_path / "x.txt", ["--plot=", "x.txt", ".png or .svg"])):
        assert cli(monkeypatch, "profile", "--check", str(tiny_profile[1]), "--num", "2",
                   "--plot", str(plot)) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("error: "), err
        assert all(n in err for n in needles), err
    assert not (tmp_path / "plots.png").exists() and not (tmp_path / "x.txt").exists()


@pytest.mark.slow
def test_ctrl_c_keeps_the_mixes_measured_and_says_so(tmp_path):
    """SIGINT mid-profile: what was measured since the last periodic save (every 20 s) was
    lost, silently (exit 130, no file, no line). Now the mix in progress ends, everything
    measured is saved, and a line says how many and that the same command resumes."""
    import os
    import re
    import select
    import signal
    import subprocess
    import time

    out = tmp_path / "p.parquet"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "profile", "--out", str(out), "--max-context", "2048",
         "--max-tokens", "512", "--max-batch", "64", "--holdout", "400", "--reps", "3",
         "--warmup", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "200"}, preexec_fn=sigint_default)
    # Interrupted once it has measured some mixes: the first line of progress it logs (every
    # 10 s when not on a terminal) counts them. Waiting a fixed time failed on a busy machine,
    # where importing torch and building the decoder took longer.
    first_line, deadline = "", time.monotonic() + 300
    while "progress" not in first_line and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
        first_line = proc.stderr.readline() if ready else ""
        if ready and not first_line:  # it ended
            break
    assert re.search(r": progress [1-9]\d*/\d+ mixes", first_line), first_line
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr
    df, _ = load(out)
    said = " ".join(stdout.split())
    assert f"interrupted: {len(df)} mixes measured -> {out}" in said, said
    assert "the same command resumes" in said and len(df) > 0


def _machine(root, meminfo: str | None, cgroup: dict[str, str]):
    if meminfo is not None:
        (root / "proc").mkdir(parents=True)
        (root / "proc" / "meminfo").write_text(meminfo)
    for name, text in cgroup.items():
        path = root / "sys" / "fs" / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = "MemTotal:       24684092 kB\nMemFree:         2000000 kB\nMemAvailable:   10000000 kB\n"


@pytest.mark.parametrize(("meminfo", "cgroup", "expected"), [
    (MEMINFO, {}, 10_240_000_000),
    (MEMINFO, {"memory.max": "max\n", "memory.current": "5\n"}, 10_240_000_000),
    (MEMINFO, {"memory.max": "4000000000\n", "memory.current": "1000000000\n"}, 3_000_000_000),
    (MEMINFO, {"memory/memory.limit_in_bytes": "9223372036854771712\n",
               "memory/memory.usage_in_bytes": "3258486784\n"}, 10_240_000_000),
    (MEMINFO, {"memory/memory.limit_in_bytes": "2000000000\n",
               "memory/memory.usage_in_bytes": "500000000\n"}, 1_500_000_000),
    ("MemTotal: 100 kB\n", {}, None),
    (None, {}, None),
], ids=["meminfo", "v2_no_limit", "v2_limit", "v1_no_limit", "v1_limit", "old_kernel", "no_proc"])
def test_the_cpu_memory_limit_is_what_is_available(tmp_path, meminfo, cgroup, expected):
    """The decoder may take 80% of the memory free now, within a container's limit; where
    Linux does not say (another OS), half the physical memory."""
    from profiler.measure.model import available_memory_bytes, memory_limit_bytes

    root = _machine(tmp_path, meminfo, cgroup)
    assert available_memory_bytes(root) == expected
    limit, how = memory_limit_bytes("cpu", root)
    if expected is None:
        assert how == "half the memory"
    else:
        assert (limit, how) == (0.8 * expected, "80% of the available memory")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_this_machine_says_what_memory_is_available():
    from profiler.measure.model import available_memory_bytes

    available = available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
