"""Per-iteration latency noise: mean 1, one stream per replica and seed, the same factor for an
iteration whether it is stepped or fast-forwarded, refused where it cannot be honest."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.config.scenario import parse_scenario
from sim.latency.noise import BLOCK, IterationNoise, NoiseConfig, mean_one_quantiles
from sim.runner import run_scenario
from tests.helpers import assert_one_line_error, run_cli


def draws(config: NoiseConfig, seed: int, n: int, quantiles=None) -> np.ndarray:
    noise = IterationNoise(config, seed, 0, quantiles)
    return noise.factors_from(0, n, np.zeros(n), np.ones(n))


@pytest.mark.parametrize("correlation", [0.0, 0.9])
def test_lognormal_factors_have_mean_one(correlation):
    sigma = 0.3
    x = draws(NoiseConfig(kind="lognormal", sigma=sigma, correlation=correlation), 1, 200_000)
    # The variance of a mean of AR(1) draws: var/n times (1 + phi')/(1 - phi'), phi' the
    # lag-1 correlation of the factors (close to phi for small sigma).
    var = math.exp(sigma**2) - 1
    inflation = (1 + correlation) / (1 - correlation)
    half_width = 4 * math.sqrt(var * inflation / len(x))
    assert abs(x.mean() - 1) < half_width
    lag1 = np.corrcoef(np.log(x[:-1]), np.log(x[1:]))[0, 1]
    assert abs(lag1 - correlation) < 0.02


def test_empirical_factors_have_mean_one_and_follow_the_regime():
    rng = np.random.default_rng(5)
    quantiles = {"decode": mean_one_quantiles(rng.gamma(50, 1, 5000)),
                 "mixed": mean_one_quantiles(rng.gamma(5, 1, 5000)),
                 "prefill": mean_one_quantiles(np.ones(10))}
    noise = IterationNoise(NoiseConfig(kind="empirical"), 3, 0, quantiles)
    n = 100_000
    decode = noise.factors_from(0, n, 0, 1)
    mixed = noise.factors_from(0, n, np.ones(n), np.ones(n))
    prefill = noise.factors_from(0, n, 1, 0)
    assert abs(decode.mean() - 1) < 4 * decode.std() / math.sqrt(n)
    assert abs(mixed.mean() - 1) < 4 * mixed.std() / math.sqrt(n)
    assert mixed.std() > 2 * decode.std()
    assert np.all(prefill == 1.0)


def test_streams_are_reproducible_per_seed_and_replica_and_block_independent():
    config = NoiseConfig(kind="lognormal", sigma=0.2, correlation=0.5)
    a = draws(config, 7, 3 * BLOCK + 5)
    assert np.array_equal(a, draws(config, 7, 3 * BLOCK + 5))
    assert not np.array_equal(a, draws(config, 8, 3 * BLOCK + 5))
    assert not np.array_equal(a[:10], IterationNoise(config, 7, 1).factors_from(0, 10, 0, 1))
    # Asked in another order (scalars late, arrays across a block boundary): the same values.
    late = IterationNoise(config, 7, 0)
    tail = late.factors_from(BLOCK - 3, 10, np.zeros(10), np.ones(10))
    assert np.array_equal(tail, a[BLOCK - 3:BLOCK + 7])
    assert [late.factor(i, 0, 1) for i in range(5)] == a[:5].tolist()


SCENARIO = """\
name: noisy
seed: {seed}
workload:
  format: synthetic
  num_requests: 300
  arrivals: {{qps: 6}}
  lengths:
    prompt: {{dist: uniform, low: 20, high: 1500}}
    output: {{dist: uniform, low: 5, high: 200}}
replica:
  latency: {{kind: roofline, noise: {noise}}}
record_token_times: true
"""


def scenario(seed: int, noise: str):
    import yaml

    return parse_scenario(yaml.safe_load(SCENARIO.format(seed=seed, noise=noise)), "<test>")


def test_fast_forward_equals_stepping_with_noise():
    s = scenario(3, "{kind: lognormal, sigma: 0.25, correlation: 0.7}")
    fast, slow = run_scenario(s), run_scenario(s, fast_forward=False)
    assert fast.iterations.equals(slow.iterations)
    assert fast.requests.equals(slow.requests)
    assert fast.summary == slow.summary


def test_noise_widens_the_tail_and_keeps_the_mean():
    quiet = run_scenario(scenario(3, "{kind: none}")).iterations
    noisy = run_scenario(scenario(3, "{kind: lognormal, sigma: 0.25}")).iterations
    # Per iteration: noisy/quiet predictions of the same shapes average 1 (the batches differ
    # once time shifts, so compare each run's durations against its own noise-free model).
    ratio = noisy["duration_s"].mean() / quiet["duration_s"].mean()
    assert 0.9 < ratio < 1.1
    assert noisy["duration_s"].quantile(0.99) > quiet["duration_s"].quantile(0.99)


def test_empirical_noise_needs_measurements(tmp_path, monkeypatch, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO.format(seed=0, noise="{kind: empirical}"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.latency.noise.kind", "no measured ratios")


@pytest.mark.parametrize(("noise", "field"), [
    ("{kind: lognormal}", "sigma"), ("{kind: none, correlation: 0.5}", "correlation"),
    ("{kind: lognormal, sigma: 0.1, correlation: 1.0}", "correlation"),
    ("{kind: empirical, sigma: 0.1}", "sigma")])
def test_bad_noise_settings_are_one_line(tmp_path, monkeypatch, capsys, noise, field):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO.format(seed=0, noise=noise))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, f"replica.latency.noise.{field}")


def test_noise_on_recorded_durations_is_refused(tmp_path, monkeypatch, capsys):
    import pandas as pd

    pd.DataFrame({"replica_id": [0, 0], "num_prefill_tokens": [8, 0],
                  "num_decode_tokens": [0, 1], "num_prefill_seqs": [1, 0],
                  "duration_s": [0.02, 0.005]}).to_parquet(tmp_path / "iterations.parquet")
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO.format(seed=0, noise="{kind: lognormal, sigma: 0.1}").replace(
        "kind: roofline,", f"kind: recorded, path: {tmp_path},"))
    code, err = run_cli(monkeypatch, capsys, "simulate", str(path), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "replica.latency.noise.kind", "count it twice")
