"""The `profile` latency model in the simulator: committed profiles, loading, errors."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profiler.fit.fitting import errors, predict
from sim import load_scenario, run_scenario
from sim.cli import main
from sim.hardware.gpus import GPUS
from sim.hardware.models import MODELS
from sim.latency import LATENCY_MODELS, BatchShape
from sim.latency.profile import token_curve
from tests.conftest import REPO, assert_one_line_error, run_cli

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


def test_fit_rejects_a_file_that_is_not_a_profile(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "x.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(bad)
    monkeypatch.setattr(sys, "argv", ["servesim", "fit", str(bad)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert "not a servesim profile" in capsys.readouterr().err


def tiny_profile_with(tmp_path, change, metadata=None):
    """The committed tiny profile's rows with `change(frame)` applied, its metadata kept
    (or replaced by `metadata`)."""
    table = pq.read_table(CPU_TINY.with_suffix(".parquet"))
    frame = table.to_pandas()
    frame = change(frame) if change is not None else frame
    out = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(
        table.schema.metadata if metadata is None else metadata)
    path = tmp_path / "p.parquet"
    pq.write_table(out, path)
    return path


def set_rows(column, value, rows=None):
    """`column` set to `value` in `rows` (every row if None)."""
    def change(frame):
        frame = frame.copy()
        if rows is None:
            frame[column] = value
        else:
            frame[column] = frame[column].astype(float)
            frame.loc[frame.index[rows], column] = value
        return frame
    return change


@pytest.mark.parametrize("change,needles", [
    (lambda f: f.iloc[0:0], ["split='0 train rows'", "two token counts"]),
    (lambda f: f[f["split"] == "holdout"], ["split='0 train rows'"]),
    (lambda f: pd.concat([f[f["split"] == "train"].head(1), f[f["split"] == "holdout"]]),
     ["split='1 train rows'"]),
    (set_rows("median_s", np.nan, slice(0, 5)), ["median_s=nan: row 0: must be a finite time"]),
    (set_rows("median_s", np.inf, 3), ["median_s=inf: row 3"]),
    (set_rows("median_s", -1.0, 3), ["median_s=-1.0: row 3"]),
    (set_rows("median_s", 0.0), ["median_s=0.0: row 0: must be a finite time > 0 s"]),
    (set_rows("num_tokens", np.nan, 3), ["num_tokens=nan: row 3: must be a whole number"]),
    (set_rows("median_s", "0.1"), ["median_s='0.1': row 0: must be a number"]),
    (set_rows("split", "nonsense"), ["split='nonsense': row 0: must be one of train, holdout"]),
    (lambda f: f.drop(columns=["decode_kv_tokens"]), ["<columns>=['decode_kv_tokens']"]),
    (lambda f: f.assign(samples_s=[[] for _ in range(len(f))]),
     ["samples_s=[]: row 0: must be a non-empty list"]),
])
def test_fit_refuses_rows_it_cannot_fit(tmp_path, monkeypatch, capsys, change, needles):
    """Each was a traceback (KeyError, numpy, scipy), a NaN error table or a hang (nnls on
    NaN), or a fit of negative times."""
    path = tiny_profile_with(tmp_path, change)
    code, err = run_cli(monkeypatch, capsys, "fit", str(path), "--out", str(tmp_path / "f.json"))
    assert_one_line_error(code, err, "p.parquet: ", *needles)
    assert not (tmp_path / "f.json").exists()


def test_fit_refuses_metadata_that_is_not_a_profiles(tmp_path, monkeypatch, capsys):
    key = b"servesim"
    for metadata, needle in (({key: b"[1, 2]"}, "metadata='list': must be a JSON object"),
                             ({key: b'{"model": 5}'}, "metadata.model=5"),
                             ({key: b'{"model": "tiny", "model": "x"}'}, "given twice"),
                             ({}, "metadata.model=None")):
        path = tiny_profile_with(tmp_path, None, metadata)
        code, err = run_cli(monkeypatch, capsys, "fit", str(path), "--out",
                            str(tmp_path / "f.json"))
        assert_one_line_error(code, err, "p.parquet: ", needle)


def test_host_overhead_comes_from_replays_only(tmp_path, monkeypatch, capsys):
    profile = tiny_profile_with(tmp_path, None)
    run = tmp_path / "run"
    run_scenario(load_scenario(scenario_with_profile(tmp_path, str(CPU_TINY))), out_dir=run)
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    # Was KeyError: 'host_s'.
    assert_one_line_error(code, err, "--host-overhead-from", "no host_s", "servesim replay")
    its = pd.read_parquet(run / "iterations.parquet")
    its.assign(host_s=np.nan).to_parquet(run / "iterations.parquet", index=False)
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    assert_one_line_error(code, err, "iterations.parquet: host_s=nan: row 0")
    (run / "iterations.parquet").write_bytes(b"garbage")
    code, err = run_cli(monkeypatch, capsys, "fit", str(profile), "--out",
                        str(tmp_path / "f.json"), "--host-overhead-from", str(run))
    assert_one_line_error(code, err, "iterations.parquet", "cannot read it")  # was pyarrow's
    assert not (tmp_path / "f.json").exists()


def test_profile_options_are_checked_before_measuring(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("garbage")
    small = ["--max-tokens", "16", "--max-batch", "1", "--holdout", "1", "--reps", "1",
             "--warmup", "0"]
    for args, needles in (
            (["--out", str(tmp_path)], ["--out", "is a directory", "name a .parquet file"]),
            (["--out", str(fifo)], ["--out", "not a regular file"]),
            (["--out", str(garbage)], ["--out", "not a profile (not parquet"]),
            # Parquet under another name would be read as neither a profile nor a fit.
            (["--out", str(tmp_path / "p.json")], ["--out", "p.json", "a .parquet file"]),
            (["--max-context", "16"], ["--max-context=16: must be at least 32"]),  # low >= high
            (["--model", "nosuch"], ["<command line>: --model='nosuch': unknown"])):
        out = [] if "--out" in args else ["--out", str(tmp_path / "p.parquet")]
        code, err = run_cli(monkeypatch, capsys, "profile", *small, *out, *args)
        assert_one_line_error(code, err, *needles)
    assert garbage.read_text() == "garbage" and not (tmp_path / "p.parquet").exists()
    assert not (tmp_path / "p.json").exists()


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
    pytest.importorskip("torch")
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
