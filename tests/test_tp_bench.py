"""torchdist_ext.bench.tp runs our TP and torch's DTensor TP side by side on tdx and counts bytes."""
from _dist import run_ranks


def _bench_rank(rank, ws):
    from torchdist_ext.bench.tp import run
    return run(steps=2, layers=1, hidden=32, heads=4, batch=2, seq=8)


def test_tp_bench_reports_both_sides_and_bytes():
    r = run_ranks(_bench_rank, 2, timeout=120)[0]
    assert r["tp"] == 2 and r["step_s"]["ours"] > 0 and r["step_s"]["dtensor"] > 0
    pb = r["param_bytes_per_rank"]
    assert pb["ours"] == pb["dtensor"] < pb["unsplit"]
    # Megatron's formula: 4 all-reduces of b*s*h fp32 per layer and step (2 forward, 2 backward);
    # Q, K and V read one input and share one all-reduce of its gradient, as a fused QKV does.
    assert r["comm_bytes_megatron_formula"] == 4 * 2 * 8 * 32 * 4
    assert r["comm_bytes_per_step_ours"] == 4 * 2 * 8 * 32 * 4
