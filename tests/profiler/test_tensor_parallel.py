"""One GPU calibrates a tensor-parallel replica: the profiler measures one shard of a T-way split
(`servesim profile --tensor-parallel T`), the fit records `tensor_parallel: T`, and the profile
latency model predicts the shard's time plus the all-reduces the roofline charges."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="the profiler needs torch (pip install -e .[profile])")

from profiler.fit.fitting import predict  # noqa: E402
from profiler.measure.model import Decoder, SeqInput  # noqa: E402
from profiler.measure.timing import load  # noqa: E402
from sim import load_scenario, run_scenario  # noqa: E402
from sim.cli import main  # noqa: E402
from sim.config.errors import InputError  # noqa: E402
from sim.hardware.gpus import GPUS  # noqa: E402
from sim.hardware.models import MODELS  # noqa: E402
from sim.hardware.parallelism import SINGLE_GPU, Parallelism  # noqa: E402
from sim.latency import LATENCY_MODELS, BatchShape  # noqa: E402
from sim.latency.comm import BandwidthCollectives, read_table  # noqa: E402
from sim.latency.profile import ProfileConfig  # noqa: E402
from sim.latency.roofline import RooflineConfig  # noqa: E402
from tests.helpers import REPO, assert_one_line_error, run_cli  # noqa: E402

TINY = MODELS.get("tiny")  # 4 layers, hidden 256, 4 heads, 2 KV heads of 64, MLP 688, vocab 4096
H100 = GPUS.get("h100-sxm")
CPU_TINY = REPO / "profiles" / "cpu_tiny.json"  # measured before tensor_parallel existed
FEATURES = ("num_prefill_tokens", "num_prefill_seqs", "num_decode_tokens", "num_sampled_tokens",
            "prefill_attn_pairs", "prefill_kv_tokens", "decode_kv_tokens")
# A small grid: enough rows for a fit, a few seconds on one CPU thread.
SMALL = ("--holdout", "12", "--reps", "2", "--warmup", "1", "--max-tokens", "128",
         "--max-context", "512", "--max-batch", "16")


@pytest.fixture(scope="module")
def tp2_profile(tmp_path_factory):
    """The tiny model's TP2 shard profiled and fitted on this CPU, through the CLI."""
    out = tmp_path_factory.mktemp("tp2") / "tiny_tp2.parquet"
    mp = pytest.MonkeyPatch()
    try:
        for args in (["profile", "--model", "tiny", "--out", str(out), "--tensor-parallel", "2",
                      *SMALL], ["fit", str(out)]):
            mp.setattr(sys, "argv", ["servesim", *args])
            try:
                main()
            except SystemExit as exc:
                assert not exc.code, args
    finally:
        mp.undo()
    return out, out.with_suffix(".json")


def profile_latency(path, parallelism=SINGLE_GPU, **knobs):
    cls = LATENCY_MODELS.get("profile")
    return cls(cls.Config(kind="profile", path=path, **knobs), TINY, H100,
               parallelism=parallelism)


def test_a_shard_holds_its_share_of_every_split_weight():
    whole, half = Decoder(TINY, 1024), Decoder(TINY, 1024, tensor_parallel=2)
    shapes = {name: tuple(w.shape) for name, w in half.layers[0].items()}
    assert shapes == {"norm1": (256,), "norm2": (256,),
                      "qkv": (2 * 64 + 2 * 1 * 64, 256),  # 2 of 4 heads, 1 of 2 KV heads
                      "o": (256, 128), "gate_up": (688, 256), "down": (256, 344)}
    for name in ("qkv", "o", "gate_up", "down"):
        assert half.layers[0][name].numel() * 2 == whole.layers[0][name].numel(), name
    assert tuple(half.lm_head.shape) == (2048, 256) and tuple(whole.lm_head.shape) == (4096, 256)
    assert tuple(half.embed.shape) == (4096, 256)  # every token id still looks up
    assert tuple(half.k_pool[0].shape) == (1024, 1, 64) == tuple(half.v_pool[0].shape)
    # Four ways: one head each, the two KV heads replicated (one per GPU).
    quarter = Decoder(TINY, 1024, tensor_parallel=4)
    assert tuple(quarter.layers[0]["qkv"].shape) == (64 + 2 * 64, 256)
    assert tuple(quarter.k_pool[0].shape) == (1024, 1, 64)
    # The shard runs a mixed batch: logits for its vocabulary slice of each sampled row.
    ids = torch.randint(0, TINY.vocab_size, (20,))
    logits = half.forward([SeqInput(0, 0, ids, True), SeqInput(512, 30, ids[:1], True)])
    assert tuple(logits.shape) == (2, 2048)
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        Decoder(TINY, 1024, tensor_parallel=3)


def test_the_paged_backend_reads_a_shards_kv_pool():
    """varlen (CUDA's paged FlashAttention; here its SDPA stand-in) on the shard's one KV head
    gives the reference path's logits."""
    from profiler.measure.mixes import Chunk, Mix
    from profiler.measure.model import reference_varlen
    from profiler.measure.timing import inputs_for

    sdpa = Decoder(TINY, 4096, seed=3, tensor_parallel=2)
    varlen = Decoder(TINY, 4096, seed=3, attention="varlen", varlen_fn=reference_varlen,
                     tensor_parallel=2)
    mix = Mix((Chunk(37, 100), Chunk(20, 0, samples=False)), (5, 300, 16))
    seqs = inputs_for(mix, TINY.vocab_size, 4096, np.random.default_rng(0), block_size=16)
    expected = sdpa.forward(seqs)
    assert tuple(expected.shape) == (4, 2048)
    assert torch.allclose(varlen.forward(seqs), expected, atol=1e-5)


def test_the_profile_and_its_fit_record_tensor_parallel(tp2_profile):
    df, meta = load(tp2_profile[0])
    assert meta["tensor_parallel"] == 2 and "--tensor-parallel 2" in meta["command"]
    assert meta["model"] == "tiny" and (df["split"] == "holdout").sum() == 12
    fitted = json.loads(tp2_profile[1].read_text())
    assert fitted["tensor_parallel"] == 2 and fitted["measurement"]["tensor_parallel"] == 2
    assert profile_latency(tp2_profile[1], Parallelism(tensor=2)).describe()[
        "tensor_parallel"] == 2
    # A profile from before the key (and its model) is one whole GPU's.
    assert "tensor_parallel" not in json.loads(CPU_TINY.read_text())
    assert profile_latency(CPU_TINY).describe()["tensor_parallel"] == 1


def shapes_of(df: pd.DataFrame) -> list[BatchShape]:
    return [BatchShape(**{k: int(r[k]) for k in FEATURES}) for _, r in df.iterrows()]


def test_prediction_is_the_shard_plus_the_communication_it_did_not_do(tp2_profile):
    df, _ = load(tp2_profile[0])
    fitted = json.loads(tp2_profile[1].read_text())
    model = profile_latency(tp2_profile[1], Parallelism(tensor=2))
    shard = predict(fitted, df)  # the fitted shard alone, as `servesim fit` scores it
    # The roofline's knobs' defaults: 2 all-reduces per layer and the embedding's, of
    # num_tokens * hidden * 2 bytes, and a gather of the sampled rows' logits (tiny's vocabulary
    # padded to a multiple of 64, 2 bytes each).
    link = BandwidthCollectives(H100.interconnect_bandwidth_bytes_s, 0.75, 25e-6, 8e-6)
    tokens = (df["num_prefill_tokens"] + df["num_decode_tokens"]).to_numpy(dtype=np.float64)
    shapes = shapes_of(df)
    sampled = np.array([s.num_sampled_tokens for s in shapes], dtype=np.float64)
    vocab = -(-MODELS.get("tiny").vocab_size // 64) * 64
    comm = (9 * link.all_reduce_s(tokens * 256 * 2, 2)
            + link.all_gather_s(sampled * vocab * 2, 2))
    got = np.array([model.iteration_time_s(s) for s in shapes])
    assert np.allclose(got, shard + comm, rtol=1e-12, atol=0)
    assert (comm > 25e-6 * 9).all()  # every iteration pays 9 start-ups at least
    for name in ("interconnect_efficiency", "all_reduce_latency_s"):
        assert ProfileConfig.model_fields[name].default == RooflineConfig.model_fields[
            name].default, name
    # Element-wise exact: a stretch of decodes as one array call, or one by one.
    kv = 300 + 8 * np.arange(40, dtype=np.int64)
    stretch = model.iteration_time_s(BatchShape.decode_only(8, kv))
    steps = [model.iteration_time_s(BatchShape.decode_only(8, int(k))) for k in kv]
    assert isinstance(steps[0], float) and stretch.tolist() == steps
    tokens_arr = np.array([0, 1, 7, 128, 4096])
    assert model.communication_s(tokens_arr).tolist() == [model.communication_s(int(n))
                                                          for n in tokens_arr]
    assert model.communication_s(0) == 0.0


def test_a_measured_all_reduce_table_replaces_the_link(tp2_profile, tmp_path):
    table = tmp_path / "all_reduce.csv"
    rows = [(size, n, 8, ms) for n in (2, 4) for size, ms in
            ((1024, 0.02 * n), (65536, 0.03 * n), (1 << 20, 0.05 * n), (1 << 24, 0.4 * n))]
    table.write_text("size,num_workers,devices_per_node,time_stats.all_reduce.median\n"
                     + "".join(f"{s},{n},{d},{t}\n" for s, n, d, t in rows))
    # The table times the all-reduces; the logits' gather (no table holds one) still starts
    # up in all_reduce_latency_s.
    model = profile_latency(tp2_profile[1], Parallelism(tensor=2), all_reduce_table=table,
                            all_reduce_latency_s=0.5)
    plain = profile_latency(tp2_profile[1], Parallelism(tensor=2))
    measured = read_table(table, "all_reduce", 2, "latency.all_reduce_table")
    shape = BatchShape(num_prefill_tokens=100, num_prefill_seqs=1, num_sampled_tokens=1,
                       prefill_attn_pairs=5050, prefill_kv_tokens=100)
    shard = (plain.iteration_time_s(shape) - plain.communication_s(100)
             - plain._gather_s(1))
    link = BandwidthCollectives(H100.interconnect_bandwidth_bytes_s, 0.75, 0.5, 8e-6)
    gather = float(link.all_gather_s(np.array(4096 * 2.0), 2))  # one row of bf16 logits
    expected = shard + 9 * float(measured(np.array(100 * 256 * 2.0))) + gather
    assert model.iteration_time_s(shape) == pytest.approx(expected, rel=1e-12)


def test_the_replica_split_must_be_the_profiled_one(tp2_profile):
    path = tp2_profile[1]
    for par in (SINGLE_GPU, Parallelism(tensor=4)):
        with pytest.raises(InputError) as exc:
            profile_latency(path, par)
        line = str(exc.value)
        assert "\n" not in line and str(path) in line and "tensor_parallel=2" in line
        assert f"parallelism.tensor {par.tensor}" in line
    with pytest.raises(InputError, match="pipeline"):
        profile_latency(path, Parallelism(tensor=2, pipeline=2))
    with pytest.raises(InputError, match="tensor_parallel=1:.*parallelism.tensor 2"):
        profile_latency(CPU_TINY, Parallelism(tensor=2))


def test_heads_that_do_not_divide_are_refused(monkeypatch, capsys, tmp_path):
    out = tmp_path / "p.parquet"
    code, err = run_cli(monkeypatch, capsys, "profile", "--model", "tiny", "--out", str(out),
                        "--tensor-parallel", "3")
    assert_one_line_error(code, err, "--tensor-parallel=3", "4 attention heads")
    assert not out.exists()
    code, err = run_cli(monkeypatch, capsys, "profile", "--out", str(out),
                        "--tensor-parallel", "0")
    assert_one_line_error(code, err, "--tensor-parallel=0")


def test_a_profile_resumes_or_checks_only_its_own_shard(tp2_profile, monkeypatch, capsys,
                                                        tmp_path):
    out = tmp_path / "again.parquet"
    out.write_bytes(tp2_profile[0].read_bytes())
    code, err = run_cli(monkeypatch, capsys, "profile", "--model", "tiny", "--out", str(out),
                        *SMALL)
    assert_one_line_error(code, err, "again.parquet: tensor_parallel=2", "--tensor-parallel 1")
    code, err = run_cli(monkeypatch, capsys, "profile", "--check", str(tp2_profile[1]),
                        "--tensor-parallel", "4")
    assert_one_line_error(code, err, "tensor_parallel=2", "--tensor-parallel is 4")


def scenario(tmp_path, profile, tensor: int) -> str:
    path = tmp_path / f"tp{tensor}.yaml"
    path.write_text(
        "name: tiny_tp\nseed: 0\n"
        "workload: {format: synthetic, num_requests: 60, arrivals: {qps: 20},\n"
        "  lengths: {prompt: {dist: lognormal, mean: 200, std: 100, max: 500},\n"
        "            output: {dist: fixed, value: 20}}}\n"
        f"replica: {{model: tiny, parallelism: {{tensor: {tensor}}},\n"
        f"  latency: {{kind: profile, path: {profile}}},\n"
        "  scheduler: {name: chunked_prefill, token_budget: 128, max_num_seqs: 16},\n"
        "  kv_cache: {num_blocks: 2000}}\n")
    return str(path)


def test_a_tp2_profile_simulates_a_tp2_scenario(tp2_profile, tmp_path, monkeypatch, capsys):
    res = run_scenario(load_scenario(scenario(tmp_path, tp2_profile[1], 2)))
    assert res.summary["requests"]["finished"] == 60
    described = res.summary["latency_model"]
    assert described["tensor_parallel"] == 2 and described["num_predicted_iterations"] > 0
    # Every iteration pays the all-reduces on top of the fitted shard.
    assert (res.iterations["duration_s"] > 8 * 25e-6).all()
    path = scenario(tmp_path, tp2_profile[1], 1)
    code, err = run_cli(monkeypatch, capsys, "simulate", path)
    assert_one_line_error(code, err, "tensor_parallel=2", "parallelism.tensor 1")
    # Placed at the scenario's field, in the scenario's file.
    assert f"{path}: replica.parallelism.tensor=1: " in err
