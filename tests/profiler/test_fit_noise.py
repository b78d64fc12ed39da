"""Noise from measurements: the fit keeps measured/predicted ratios by regime and their lag-1
correlation in run order; a profile latency model serves them to `noise: {kind: empirical}`;
older profiles, without them, refuse empirical noise in one line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from profiler.fit.fitting import MIN_REGIME_SAMPLES, fit_profile, measured_noise, predict
from profiler.measure.mixes import GridSpec, grid, random_mixes
from sim.config.errors import InputError
from sim.config.scenario import parse_scenario
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS
from sim.latency.noise import REGIMES, regime_index
from sim.latency.profile import FORMAT, TERMS, load_fitted, predict_s
from sim.runner import run_scenario
from tests.helpers import REPO, assert_one_line_error, requires_torch, run_cli, run_cli_out

CPU_TINY = REPO / "profiles" / "cpu_tiny.json"
SPEC = GridSpec(max_tokens=512, max_context=2048, max_batch=64, max_kv_tokens=65536)
# A known model: g(tokens) linear, every term on (what the fit's model class holds exactly).
KNOTS = np.array([1.0, 512.0])
KNOT_S = np.array([2e-3, 2e-3 + 511 * 4e-6])
COEF = [8e-8, 7e-7, 9e-7, 1.5e-4, 2.5e-4, 1e-5]
FEATURES = ("num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
            "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")


def synthetic_profile(sigma: float, phi: float, reps: int = 6, holdout: int = 300,
                      seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """A profile's frame as `servesim profile` writes it (mixes in random order, repetitions
    back to back), timed by the known model times exp(sigma z - sigma^2/2), z an AR(1) with
    coefficient phi over the whole run (standard normal at every step)."""
    rng = np.random.default_rng(seed)
    mixes = [(m, "train") for m in grid(SPEC, rng)]
    mixes += [(m, "holdout") for m in random_mixes(SPEC, holdout, rng)]
    mixes = [mixes[i] for i in rng.permutation(len(mixes))]
    z = np.empty(len(mixes) * reps)
    z[0] = rng.standard_normal()
    for i in range(1, z.size):
        z[i] = phi * z[i - 1] + math.sqrt(1 - phi * phi) * rng.standard_normal()
    rows = []
    for i, (mix, split) in enumerate(mixes):
        shape = mix.shape()
        true_s = float(predict_s(shape, KNOTS, KNOT_S, COEF))
        samples = true_s * np.exp(sigma * z[i * reps:(i + 1) * reps] - sigma**2 / 2)
        rows.append({"key": mix.key, "tag": mix.tag, "split": split,
                     **{name: int(getattr(shape, name)) for name in FEATURES},
                     "num_tokens": mix.num_tokens, "median_s": float(np.median(samples)),
                     "p10_s": float(np.percentile(samples, 10)),
                     "p90_s": float(np.percentile(samples, 90)), "samples_s": samples.tolist()})
    return pd.DataFrame(rows), {"model": "tiny", "reps": reps, "device_name": "synthetic"}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[dict, Path]:
    df, meta = synthetic_profile(sigma=0.1, phi=0.6)
    fitted = fit_profile(df, meta)
    path = tmp_path_factory.mktemp("noise") / "synthetic.json"
    path.write_text(json.dumps(fitted, indent=1, sort_keys=True) + "\n")
    return fitted, path


def profile_model(path: Path):
    cls = LATENCY_MODELS.get("profile")
    return cls(cls.Config(kind="profile", path=path), MODELS.get("tiny"), GPUS.get("h100-sxm"))


def test_known_lognormal_noise_comes_back_as_the_ratios_spread_and_correlation(synthetic):
    fitted, path = synthetic
    noise = fitted["noise"]
    assert set(noise["regimes"]) == set(REGIMES)
    for name in REGIMES:
        regime = noise["regimes"][name]
        q = np.asarray(regime["quantiles"])
        assert len(q) == 101 and np.all(np.diff(q) >= 0) and np.all(q > 0)
        assert regime["count"] >= MIN_REGIME_SAMPLES and regime["source"] in ("holdout", "all")
        # The fit recovers the model (it is in its class), so log(ratio) ~ N(-s^2/2, s^2).
        assert regime["log_std"] == pytest.approx(0.1, abs=0.015), name
        assert np.median(q) == pytest.approx(1.0, abs=0.03), name
        # From the quantiles alone: the interquartile range of N(0, 0.1) in log.
        iqr = math.log(q[75] / q[25])
        assert iqr == pytest.approx(2 * 0.6745 * 0.1, rel=0.2), name
    # Held-out mixes where a regime has enough; prefill-only held-out mixes are rare.
    assert noise["regimes"]["mixed"]["source"] == "holdout"
    assert noise["correlation"] == pytest.approx(0.6, abs=0.07)
    assert noise["correlation_from"] == "consecutive repetitions of a mix"
    assert "latency.noise" in noise["correlation_note"]
    # The spread statistics the file kept before stay beside the ratios.
    assert {"median_rel_abs_dev", "p95_rel_abs_dev"} <= set(noise)
    assert load_fitted(path)["noise"]["correlation"] == noise["correlation"]


def test_independent_noise_fits_no_correlation():
    df, meta = synthetic_profile(sigma=0.1, phi=0.0, seed=1)
    assert fit_profile(df, meta)["noise"]["correlation"] < 0.07


def test_one_repetition_per_mix_correlates_consecutive_mixes():
    df, meta = synthetic_profile(sigma=0.1, phi=0.6, reps=1, seed=2)
    noise = measured_noise(fit_profile(df, meta), df)
    assert noise["correlation_from"].startswith("consecutive mixes")
    assert noise["correlation_detail"]["mixes"] == "holdout"  # adjacent held-out mixes
    # Fitted to single timings, the model's own error (independent from mix to mix) dilutes
    # the drift's correlation: below 0.6, well above none.
    assert 0.4 < noise["correlation"] < 0.7


def test_a_regime_with_too_few_timings_falls_back_to_the_pooled_ratios():
    df, meta = synthetic_profile(sigma=0.1, phi=0.0, seed=3)
    regime = regime_index(df["num_prefill_tokens"], df["num_decode_tokens"])
    prefill = np.flatnonzero(regime == 2)
    few = df.drop(index=df.index[prefill[3:]])  # three prefill-only mixes of six timings
    fitted = fit_profile(few, meta)
    got = fitted["noise"]["regimes"]["prefill"]
    assert got["source"] == "pooled_holdout" and got["own_count"] == 18
    assert "pooled" in got["note"]
    pooled = fitted["noise"]["regimes"]
    assert got["count"] > pooled["mixed"]["count"]
    # Held-out ratios are honest: what the fitted model says against what was timed.
    holdout = few[few["split"] == "holdout"]
    ratios = np.concatenate([np.asarray(s) / p for s, p in
                             zip(holdout["samples_s"], predict(fitted, holdout), strict=True)])
    assert got["count"] == ratios.size
    assert np.quantile(ratios, 0.5) == pytest.approx(np.median(got["quantiles"]), rel=1e-9)


def test_the_model_serves_mean_one_quantiles_and_says_the_correlation(synthetic):
    fitted, path = synthetic
    model = profile_model(path)
    quantiles = model.noise_quantiles()
    assert quantiles is not None and set(quantiles) == set(REGIMES)
    for name, q in quantiles.items():
        assert len(q) == 257 and np.all(np.diff(q) >= 0)
        assert float(((q[1:] + q[:-1]) / 2).mean()) == pytest.approx(1.0, abs=1e-12)
        stored = np.asarray(fitted["noise"]["regimes"][name]["quantiles"])
        # The stored quantile function, resampled and rescaled (by its mean: ~1 already).
        assert q[128] == pytest.approx(np.median(stored) / stored.mean(), rel=0.02)
    facts = model.describe()["measured_noise"]
    assert facts["correlation"] == fitted["noise"]["correlation"]
    assert f"correlation: {facts['correlation']}" in facts["use"]
    assert facts["ratios"]["mixed"] == {"count": fitted["noise"]["regimes"]["mixed"]["count"],
                                        "source": "holdout"}


def test_the_committed_cpu_profile_keeps_its_ratios():
    fitted = load_fitted(CPU_TINY)
    noise = fitted["noise"]
    assert 0 <= noise["correlation"] < 1
    for name in REGIMES:
        assert noise["regimes"][name]["count"] >= MIN_REGIME_SAMPLES
        assert 0.02 < noise["regimes"][name]["log_std"] < 0.5  # a CPU: jitter and model error
    # Computed from the committed measurements with the committed fit.
    df = pd.read_parquet(CPU_TINY.with_suffix(".parquet"))
    again = measured_noise(fitted, df)
    assert again["regimes"] == noise["regimes"] and again["correlation"] == noise["correlation"]


def old_profile(tmp_path: Path, keep_stats: bool) -> Path:
    """cpu_tiny as fitted before ratios were kept: spread statistics only, or no `noise`."""
    data = json.loads(CPU_TINY.read_text())
    stats = {k: v for k, v in data["noise"].items()
             if k in ("median_p10_p90_spread", "median_rel_abs_dev", "p95_rel_abs_dev")}
    if keep_stats:
        data["noise"] = stats
    else:
        del data["noise"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("keep_stats", [True, False])
def test_an_old_profile_loads_and_keeps_no_ratios(tmp_path, keep_stats):
    path = old_profile(tmp_path, keep_stats)
    model = profile_model(path)
    assert model.noise_quantiles() is None
    assert model.describe()["measured_noise"] is None
    pytest.importorskip("torch", reason="profiler.replay.validate_profile needs torch")
    from profiler.replay.validate_profile import noise_correlation

    assert noise_correlation(path) is None


SCENARIO = """\
name: profile_noise
seed: {seed}
workload:
  format: synthetic
  num_requests: 150
  arrivals: {{qps: 8}}
  lengths:
    prompt: {{dist: lognormal, mean: 300, std: 250, max: 1500}}
    output: {{dist: lognormal, mean: 60, std: 50, max: 300}}
replica:
  model: tiny
  scheduler: {{name: chunked_prefill, token_budget: 256, max_num_seqs: 64}}
  latency: {{kind: profile, path: {path}, noise: {noise}}}
  kv_cache: {{block_size: 16, num_blocks: 4096}}
record_token_times: true
"""


def scenario(seed: int, noise: str, path: Path = CPU_TINY):
    text = SCENARIO.format(seed=seed, noise=noise, path=path)
    return parse_scenario(yaml.safe_load(text), "<test>")


@pytest.mark.parametrize("noise", ["{kind: empirical}", "{kind: empirical, correlation: 0.73}"])
def test_empirical_noise_runs_reproducibly_and_fast_forward_equals_stepping(noise):
    s = scenario(4, noise)
    fast, slow = run_scenario(s), run_scenario(s, fast_forward=False)
    assert fast.iterations.equals(slow.iterations)
    assert fast.requests.equals(slow.requests)
    again = run_scenario(scenario(4, noise))
    assert again.iterations.equals(fast.iterations) and again.requests.equals(fast.requests)
    other = run_scenario(scenario(5, noise))
    quiet = run_scenario(scenario(4, "{kind: none}"))
    assert not other.iterations["duration_s"].equals(fast.iterations["duration_s"])
    assert fast.summary["requests"]["finished"] == 150
    # Decode-only iterations of one batch size differ by their contexts alone without noise
    # (a few %), by the profile's decode ratios (log-std 0.17) with it.
    assert decode_spread(fast.iterations) > 2 * decode_spread(quiet.iterations)


def decode_spread(its: pd.DataFrame) -> float:
    """Median over batch sizes of the log-std of decode-only iterations' durations."""
    decode = its[its["num_prefill_tokens"] == 0]
    return float(np.log(decode["duration_s"]).groupby(decode["num_decode_tokens"]).std().median())


def test_empirical_noise_with_the_synthetic_profile_has_mean_one(synthetic):
    _, path = synthetic
    quiet = run_scenario(scenario(1, "{kind: none}", path)).iterations
    noisy = run_scenario(scenario(1, "{kind: empirical, correlation: 0.6}", path)).iterations
    ratio = noisy["duration_s"].mean() / quiet["duration_s"].mean()
    assert 0.9 < ratio < 1.1


@pytest.mark.parametrize("keep_stats", [True, False])
def test_an_old_profile_refuses_empirical_noise_in_one_line(tmp_path, monkeypatch, capsys,
                                                            keep_stats):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO.format(seed=0, noise="{kind: empirical}",
                                    path=old_profile(tmp_path, keep_stats)))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.latency.noise.kind", "no measured ratios")


@pytest.mark.parametrize(("change", "field"), [
    (lambda n: n["regimes"]["decode"]["quantiles"].__setitem__(3, -0.5),
     "noise.regimes.decode.quantiles.3"),
    (lambda n: n["regimes"]["mixed"]["quantiles"].__setitem__(50, 1e-9),
     "noise.regimes.mixed.quantiles.50"),
    (lambda n: n["regimes"]["prefill"].__setitem__("quantiles", [1.0]),
     "noise.regimes.prefill.quantiles"),
    (lambda n: n["regimes"].pop("mixed"), "noise.regimes.mixed"),
    (lambda n: n["regimes"]["decode"].__setitem__("count", 0), "noise.regimes.decode.count"),
    (lambda n: n.__setitem__("correlation", 1.0), "noise.correlation"),
])
def test_a_broken_noise_section_is_reported_at_its_field(tmp_path, change, field):
    data = json.loads(CPU_TINY.read_text())
    change(data["noise"])
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as exc:
        load_fitted(path)
    assert field in exc.value.one_line(), exc.value.one_line()


def test_non_finite_ratios_are_refused(tmp_path):
    text = CPU_TINY.read_text()
    data = json.loads(text)
    data["noise"]["regimes"]["decode"]["quantiles"][-1] = float("inf")
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(data))  # Infinity: Python's json reads it back, a strict read not
    with pytest.raises(InputError, match=r"not JSON \(Infinity is not a JSON number\)"):
        load_fitted(path)
    data["noise"]["regimes"]["decode"]["quantiles"][-1] = 0.0
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="noise.regimes.decode.quantiles.100"):
        load_fitted(path)


@requires_torch  # profiler.replay.validate_profile imports the replay's torch code
def test_validate_keeps_the_noise_facts_without_the_quantiles(synthetic):
    from profiler.replay.validate_profile import noise_correlation, noise_facts

    fitted, path = synthetic
    facts = noise_facts(fitted)
    assert facts is not None and facts["correlation"] == fitted["noise"]["correlation"]
    assert all("quantiles" not in r and r["count"] > 0 for r in facts["regimes"].values())
    assert noise_correlation(path) == fitted["noise"]["correlation"]
    assert noise_facts({"format": FORMAT}) is None
    assert len(TERMS) == len(COEF)


def test_fit_through_the_cli_writes_the_noise_section(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch", reason="profiler.measure.timing needs torch")
    from profiler.measure.timing import save

    df, meta = synthetic_profile(sigma=0.05, phi=0.3, reps=4, holdout=120, seed=6)
    parquet = tmp_path / "p.parquet"
    save(parquet, df.to_dict("records"), meta)
    code, _ = run_cli_out(monkeypatch, capsys, "fit", str(parquet))
    assert code == 0
    fitted = load_fitted(parquet.with_suffix(".json"))
    assert fitted["noise"]["regimes"]["decode"]["log_std"] == pytest.approx(0.05, abs=0.015)
    assert profile_model(parquet.with_suffix(".json")).noise_quantiles() is not None


def test_fit_never_writes_over_the_profile_it_fits(tmp_path, monkeypatch, capsys):
    # `--out` the measured parquet itself would replace the measurements with JSON; a
    # directory, a FIFO or a missing directory would be a traceback or a hang.
    pytest.importorskip("torch", reason="profiler.measure.timing needs torch")
    from profiler.measure.timing import save

    df, meta = synthetic_profile(sigma=0.05, phi=0.3, reps=2, holdout=20, seed=1)
    parquet = tmp_path / "p.parquet"
    save(parquet, df.to_dict("records"), meta)
    before = parquet.read_bytes()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for out, needle in ((parquet, "the profile being fitted"), (tmp_path, "a directory"),
                        (fifo, "not a regular file"),
                        (tmp_path / "no" / "p.json", "does not exist")):
        code, err = run_cli(monkeypatch, capsys, "fit", str(parquet), "--out", str(out))
        assert_one_line_error(code, err, needle)
    assert parquet.read_bytes() == before
