"""The `profile` latency model in the simulator: committed profiles, loading, errors."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from profiler.fit.fitting import errors, predict
from sim import load_scenario, run_scenario
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape
from sim.latency.profile import token_curve
from tests.helpers import REPO, assert_one_line_error, run_cli

PROFILES = sorted((REPO / "profiles").glob("*.json"))


CPU_TINY = REPO / "profiles" / "cpu_tiny.json"


def profile_model(path, model="tiny"):
    cls = LATENCY_MODELS.get("profile")
    return cls(cls.Config(kind="profile", path=path), MODELS.get(model), GPUS.get("h100-sxm"))


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_committed_profile_matches_its_own_held_out_rows(path):
    fitted = json.loads(path.read_text())
    measured = pq.read_table(path.with_suffix(".parquet")).to_pandas()
    holdout = measured[measured["split"] == "holdout"]
    assert len(holdout) >= 200
    result = errors(fitted, holdout)
    assert result == pytest.approx(fitted["holdout"])  # the file says what the data say
    bound = 0.03 if "cpu" not in fitted["device_name"] else 0.20  # GPU target; CPU: see README
    assert result["mape"] <= bound
    meta = fitted["measurement"]
    for key in ("device_name", "torch", "dtype", "date", "command", "attention_backend"):
        assert meta[key], key


def test_simulator_prediction_equals_the_fit():
    fitted = json.loads(CPU_TINY.read_text())
    measured = pq.read_table(CPU_TINY.with_suffix(".parquet")).to_pandas()
    model = profile_model(CPU_TINY)
    rows = measured.head(50)
    one_by_one = [model.iteration_time_s(BatchShape(**{k: int(r[k]) for k in (
        "num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
        "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")}))
        for _, r in rows.iterrows()]
    assert np.allclose(one_by_one, predict(fitted, rows), rtol=1e-12)
    kv = 800 + 8 * np.arange(40, dtype=np.int64)
    stretch = np.broadcast_to(model.iteration_time_s(BatchShape.decode_only(8, kv)), (40,))
    steps = [model.iteration_time_s(BatchShape.decode_only(8, 800 + 8 * j)) for j in range(40)]
    assert stretch.tolist() == [float(s) for s in steps]


def test_extrapolation_is_counted_and_reported():
    model = profile_model(CPU_TINY)
    limit = model.limits["num_tokens"]
    model.iteration_time_s(BatchShape(num_prefill_tokens=int(limit) + 100, num_prefill_seqs=1,
                                      num_sampled_tokens=1, prefill_attn_pairs=10,
                                      prefill_kv_tokens=10))
    model.iteration_time_s(BatchShape.decode_only(2, 20))
    assert model.describe()["num_extrapolated_iterations"] == 1
    assert model.describe()["num_predicted_iterations"] == 2


def test_scenario_with_profile_latency_runs():
    res = run_scenario(load_scenario(REPO / "scenarios" / "tiny_cpu_profile.yaml"))
    assert res.summary["requests"]["finished"] == 400
    assert res.summary["latency_model"]["model"] == "tiny"
    assert res.summary["latency_model"]["num_predicted_iterations"] >= 1
    # iteration times are the fitted curve's, not a constant
    assert res.iterations["duration_s"].nunique() > 100


def scenario_with_profile(tmp_path, profile: str, model: str = "tiny") -> str:
    path = tmp_path / "s.yaml"
    path.write_text(f"workload: {{format: synthetic, num_requests: 5, arrivals: {{qps: 1}},\n"
                    f"  lengths: {{prompt: {{dist: fixed, value: 10}}, "
                    f"output: {{dist: fixed, value: 2}}}}}}\n"
                    f"replica: {{model: {model}, latency: {{kind: profile, path: {profile}}},\n"
                    f"  kv_cache: {{num_blocks: 100}}}}\n")
    return str(path)


@pytest.mark.parametrize("content,model,needles", [
    ("{not json", "tiny", ["latency.path", "not JSON"]),
    ('{"format": "other"}', "tiny", ["format='other'", "servesim fit"]),
    (None, "llama-3-8b", ["model='tiny'", "measured for tiny"]),
    ("missing", "tiny", ["latency.path", "file not found"]),
    # Read strictly (sim.config.input_file): these were a traceback or, for a key given twice, the
    # last value taken silently.
    (CPU_TINY.read_text().rstrip()[:-1] + ', "model": "llama-3-8b", "model": "tiny"}', "tiny",
     ["latency.path", "model='tiny', then 'llama-3-8b': given twice"]),
    ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "tiny", ["not JSON (nested too deeply)"]),
    ('{"tensor_parallel": ' + "9" * 5000 + "}", "tiny", ["an integer of 5000 digits"]),
])
def test_bad_profiles_give_one_line_errors(tmp_path, monkeypatch, capsys, content, model,
                                           needles):
    if content is None:
        profile = CPU_TINY
    else:
        profile = tmp_path / "p.json"
        if content != "missing":
            profile.write_text(content)
    code, err = run_cli(monkeypatch, capsys, "simulate",
                        scenario_with_profile(tmp_path, str(profile), model))
    assert_one_line_error(code, err, *needles)


def broken(change):
    """The committed tiny profile with `change(data)` applied."""
    data = json.loads(CPU_TINY.read_text())
    change(data)
    return data


@pytest.mark.parametrize("change,needles", [
    (lambda d: d.pop("knots"), ["knots=<missing>: required"]),
    (lambda d: d["range"].pop("num_tokens"), ["range.num_tokens=<missing>"]),
    (lambda d: d.update(knots="abc"), ["knots='abc'", "list"]),
    (lambda d: d.update(coef=[1, 2]), ["coef=[1, 2]", "mapping"]),
    (lambda d: d["coef"].update(decode_kv_tokens="1e-6"), ["coef.decode_kv_tokens='1e-6'", "text"]),
    (lambda d: d["coef"].update(num_sampled_tokens=True), ["coef.num_sampled_tokens=True",
                                                           "boolean"]),
    (lambda d: d["coef"].update(decode_kv_tokens=-1e-6), ["coef.decode_kv_tokens=-1e-06",
                                                          "greater than or equal to 0"]),
    (lambda d: d["knot_s"].__setitem__(2, -0.5), ["knot_s.2=-0.5"]),
    # Not JSON, which a strict reader refuses before any field (Python's json writes them).
    (lambda d: d["knot_s"].__setitem__(2, float("nan")), ["not JSON (NaN is not a JSON number)"]),
    (lambda d: d["coef"].update(prefill_kv_tokens=float("inf")), ["Infinity is not a JSON"]),
    (lambda d: d["knots"].__setitem__(3, 1.0), ["knots.3=1.0", "increase"]),
    (lambda d: d["knot_s"].pop(), ["knot_s=", "one per knot"]),
    (lambda d: d["range"].update(num_tokens=-5), ["range.num_tokens=-5"]),
])
def test_a_broken_fitted_profile_names_its_field(tmp_path, monkeypatch, capsys, change, needles):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(broken(change)))  # NaN and Infinity as Python's json writes
    code, err = run_cli(monkeypatch, capsys, "simulate",
                        scenario_with_profile(tmp_path, str(profile)))
    assert_one_line_error(code, err, str(profile), *needles)


def test_every_problem_of_a_fitted_profile_at_once(tmp_path, monkeypatch, capsys):
    def change(d):
        d.pop("model")
        d["coef"]["num_decode_tokens"] = -1.0
        d["knots"][5] = 0.5

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(broken(change)))
    code, err = run_cli(monkeypatch, capsys, "simulate",
                        scenario_with_profile(tmp_path, str(profile)))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err  # knot order is checked once the fields are valid
    assert lines[0].startswith(f"error: {profile}: model=<missing>")
    assert lines[1].startswith(f"error: {profile}: coef.num_decode_tokens=-1.0")


def test_a_directory_given_as_the_profile(tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "simulate",
                        scenario_with_profile(tmp_path, str(tmp_path)))
    assert_one_line_error(code, err, "latency.path", "is a directory")


def test_beyond_the_measured_tokens_the_curve_never_turns_down():
    """The committed CPU profile's last segment slopes down (timing noise over 16 tokens);
    extended along it, a 4,352-token prefill was predicted at -18.7 ms and stopped a run."""
    fitted = json.loads((REPO / "profiles" / "cpu_tiny.json").read_text())
    knots, values = np.asarray(fitted["knots"]), np.asarray(fitted["knot_s"])
    assert values[-1] < values[-2]  # the noisy last segment this guards against
    tokens = np.array([knots[-1], 1024, 4352, 100_000])
    curve = token_curve(tokens, knots, values)
    assert (np.diff(curve) > 0).all() and curve[0] == values[-1]
    model = LATENCY_MODELS.get("profile")(
        LATENCY_MODELS.get("profile").Config(kind="profile", path=REPO / "profiles" /
                                             "cpu_tiny.json"), MODELS.get("tiny"),
        GPUS.get("h100-sxm"))
    q = 4352
    shape = BatchShape(num_prefill_tokens=q, num_prefill_seqs=1, num_sampled_tokens=1,
                       prefill_attn_pairs=q * (q + 1) // 2, prefill_kv_tokens=q)
    assert model.iteration_time_s(shape) > model.iteration_time_s(
        BatchShape(num_prefill_tokens=512, num_prefill_seqs=1, num_sampled_tokens=1,
                   prefill_attn_pairs=512 * 513 // 2, prefill_kv_tokens=512)) > 0


def test_a_fitted_file_given_by_an_option_is_named_by_it(tmp_path, monkeypatch, capsys):
    """`profile --check nope.json` said `latency.path='nope.json'`, a scenario's field; so did
    `validate --profile`."""
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[profile]'")
    code, err = run_cli(monkeypatch, capsys, "profile", "--check", str(tmp_path / "nope.json"))
    assert_one_line_error(code, err, "--check=", "nope.json", "file not found")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nworkload: {format: synthetic, num_requests: 4, arrivals: "
                        "{qps: 10}, lengths: {prompt: {dist: uniform, low: 10, high: 90}, "
                        "output: {dist: uniform, low: 2, high: 12}}}\n"
                        "replica: {model: tiny, kv_cache: {num_blocks: 64}}\n")
    code, err = run_cli(monkeypatch, capsys, "validate", str(scenario), "--profile",
                        str(tmp_path / "nope.json"), "--out", str(tmp_path / "v"))
    assert_one_line_error(code, err, "--profile=", "nope.json", "file not found")
