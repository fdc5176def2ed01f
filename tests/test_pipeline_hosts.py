"""Pipelines across real hosts (2 test hosts x 2 ranks, tests/_testhosts.py): pp=4 with the host link
between stages 1 and 2, pp=2 x dp=2 and pp=2 x tp=2 on a DeviceMesh with the pipeline across the hosts
and the other dimension inside each, and dp=2 x pp=2 x tp=2 on 2 hosts x 4 ranks (pp across the hosts,
dp and tp inside). Each runs GPipe, 1F1B and ZB-V (the 3D mesh: 1F1B and ZB-V) for a few SGD steps;
losses, gradients and parameters equal the unsplit model trained in one process.

Layout: a pipeline sends one activation (and one gradient) per micro-batch between neighbouring
stages, while data and tensor parallelism all-reduce every gradient or every layer's output; so the
pipeline dimension is the one that crosses the host link, and the others stay in shared memory.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _pipe_runs import assert_matches, reference_steps, train_steps
from _testhosts import TestHosts, unavailable_reason
from test_hosts import collect, start_job
from test_pipeline_zero_bubble import BATCH, LR, STEPS, _batch, _parts

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

KINDS = ("gpipe", "1f1b", "zbv")
M = 4  # micro-batches per step (per replica)
TP_WIDTH, TP_HEADS, TP_SEQ = 16, 4, 6


def _schedule(kind, stages, loss_fn=nn.functional.cross_entropy):
    from torchdist_ext.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

    if kind == "zbv":
        return ScheduleZBVZeroBubble(stages, n_microbatches=M, loss_fn=loss_fn)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], M, loss_fn=loss_fn)


def _stage_indices(kind, pp_rank, pp):
    return [pp_rank, 2 * pp - 1 - pp_rank] if kind == "zbv" else [pp_rank]


def _replica_batch(replica, dp):
    """Replica ``replica`` of ``dp`` trains on its contiguous share of the global batch."""
    share = BATCH // dp
    return lambda step: tuple(t[replica * share:(replica + 1) * share] for t in _batch(step))


def _average_grads(params, group, n):
    """The data-parallel step of a zero-bubble pipeline (which refuses DDP inside its stages): the mean
    gradient over the replicas, after the step's last W."""
    for p in params:
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(n)


def _pp_dp_run(kind, pp_group, pp_rank, pp, dp_group, dp_rank, dp):
    """One pipeline of a pp x dp job: 1F1B / GPipe with our DDP inside each stage, ZB-V with the
    gradients averaged after the step."""
    import torchdist_ext
    from torchdist_ext.pipeline import PipelineStage

    mine = _stage_indices(kind, pp_rank, pp)
    n_stages = pp * len(mine)
    parts = _parts(n_stages)
    if dp > 1 and kind != "zbv":
        wrapped = {s: torchdist_ext.DistributedDataParallel(parts[s], process_group=dp_group) for s in mine}
    else:
        wrapped = {s: parts[s] for s in mine}
    stages = [PipelineStage(wrapped[s], s, n_stages, "cpu", group=pp_group) for s in mine]
    params = [p for s in mine for p in parts[s].parameters()]
    after = (lambda: _average_grads(params, dp_group, dp)) if dp > 1 and kind == "zbv" else None
    return train_steps(_schedule(kind, stages), parts, mine, n_stages, _replica_batch(dp_rank, dp), STEPS, LR,
                       after_backward=after)


def _pp_tp_run(kind, pp_group, pp_rank, pp, tp_mesh):
    """One pipeline stage set of transformer blocks, each split by Megatron TP over the mesh's tp dim."""
    from torchdist_ext import tensor_parallel as tp
    from torchdist_ext.pipeline import PipelineStage

    mine = _stage_indices(kind, pp_rank, pp)
    n_stages = pp * len(mine)
    parts = _tp_parts(n_stages)
    for s in mine:
        tp.parallelize_module(parts[s], tp_mesh, tp.models.block_plan())
    stages = [PipelineStage(parts[s], s, n_stages, "cpu", group=pp_group) for s in mine]
    out = train_steps(_schedule(kind, stages, loss_fn=nn.functional.mse_loss), parts, mine, n_stages, _tp_batch,
                      STEPS, LR)
    out["layout"] = {s: tp.tp_layout(parts[s]) for s in mine}
    return out


def _tp_parts(n_stages):
    from torchdist_ext.tensor_parallel.models import Block

    torch.manual_seed(0)
    return [Block(TP_WIDTH, TP_HEADS) for _ in range(n_stages)]


def _tp_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(BATCH // 2, TP_SEQ, TP_WIDTH, generator=g),
            torch.randn(BATCH // 2, TP_SEQ, TP_WIDTH, generator=g))


def _hosts_of(rank):
    import socket

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _pipelines_2x2(rank, ws):
    """Every 4-rank layout and schedule of this file in one job: {(layout, kind): train_steps' result}."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {"hosts": _hosts_of(rank)}
    for kind in KINDS:
        out[("pp4", kind)] = _pp_dp_run(kind, dist.group.WORLD, rank, ws, None, 0, 1)
    # Ranks 0, 1 share a host (torchrun numbers a node's ranks consecutively): the mesh's first dim,
    # pp, pairs ranks {0, 2} and {1, 3} across the hosts; the second, dp or tp, stays on each host.
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    from torchdist_ext.pipeline._comm import posts_from_thread, posts_receives_early
    out["posts_early"] = {"world": posts_receives_early(dist.group.WORLD, "cpu"),
                          "pp": posts_receives_early(dm.get_group("pp"), "cpu"),
                          "dp": posts_receives_early(dm.get_group("dp"), "cpu")}
    out["from_thread"] = {n: posts_from_thread(dm.get_group(n), "cpu") for n in ("pp", "dp")}
    for kind in KINDS:
        out[("pp2xdp2", kind)] = _pp_dp_run(kind, dm.get_group("pp"), dm.get_local_rank("pp"), 2,
                                            dm.get_group("dp"), dm.get_local_rank("dp"), 2)
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    for kind in KINDS:
        out[("pp2xtp2", kind)] = _pp_tp_run(kind, dm.get_group("pp"), dm.get_local_rank("pp"), 2, dm["tp"])
        out[("pp2xtp2", kind)]["tp_rank"] = dm.get_local_rank("tp")
    return out


def _pipelines_3d(rank, ws):
    """dp=2 x pp=2 x tp=2 on 2 hosts x 4 ranks: pp across the hosts; dp and tp inside each."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    out = {"hosts": _hosts_of(rank), "coords": {n: dm.get_local_rank(n) for n in ("pp", "dp", "tp")}}
    for kind in ("1f1b", "zbv"):
        out[kind] = _pp_3d_run(kind, dm)
    return out


def _pp_3d_run(kind, dm):
    from torchdist_ext import tensor_parallel as tp
    from torchdist_ext.pipeline import PipelineStage

    pp_rank, dp_rank = dm.get_local_rank("pp"), dm.get_local_rank("dp")
    mine = _stage_indices(kind, pp_rank, 2)
    n_stages = 2 * len(mine)
    parts = _tp_parts(n_stages)
    for s in mine:
        tp.parallelize_module(parts[s], dm["tp"], tp.models.block_plan())
    stages = [PipelineStage(parts[s], s, n_stages, "cpu", group=dm.get_group("pp")) for s in mine]
    params = [p for s in mine for p in parts[s].parameters()]
    share = (BATCH // 2) // 2

    def batch(step):
        return tuple(t[dp_rank * share:(dp_rank + 1) * share] for t in _tp_batch(step))

    out = train_steps(_schedule(kind, stages, loss_fn=nn.functional.mse_loss), parts, mine, n_stages, batch, STEPS,
                      LR, after_backward=lambda: _average_grads(params, dm.get_group("dp"), 2))
    out["layout"] = {s: tp.tp_layout(parts[s]) for s in mine}
    return out


# ---------------------------------------------------------------- references in one process


def _reference(parts, batch, loss_fn, dp=1):
    """The unsplit model on the global batch in one process; ``replica_loss[d][step]``: the loss the
    pipeline of replica ``d`` reports (the mean over its share of the batch of its micro-batches' losses)."""
    model = nn.Sequential(*parts)
    shares = []

    def loss_of(x, y):
        per = [sum(loss_fn(model(a), b) for a, b in zip(xd.chunk(M), yd.chunk(M))) / M
               for xd, yd in zip(x.chunk(dp), y.chunk(dp))]
        shares.append([v.item() for v in per])
        return sum(per) / dp

    ref = reference_steps(parts, batch, STEPS, LR, loss_of)
    ref["replica_loss"] = [[s[d] for s in shares] for d in range(dp)]
    return ref


def _merge_tp(per_tp_rank, layouts):
    """The per-tp-rank results of one pipeline rank merged into the unsplit tensors' names and shapes
    (split tensors concatenated along their dim; replicated ones checked equal on every tp rank)."""
    def merge(dicts):
        out = {}
        for name in dicts[0]:
            s, key = name.split(".", 1)
            dim = layouts[int(s)].get(key)
            if dim is None:
                for r, d in enumerate(dicts[1:], 1):
                    torch.testing.assert_close(d[name], dicts[0][name], msg=f"{name}: tp rank {r} differs from 0")
                out[name] = dicts[0][name]
            else:
                out[name] = torch.cat([d[name] for d in dicts], dim)
        return out

    return {"loss": per_tp_rank[0]["loss"], "grads": [merge([r["grads"][i] for r in per_tp_rank]) for i in range(STEPS)],
            "params": merge([r["params"] for r in per_tp_rank])}


def _check(per_rank, ref, what, replica_of=lambda r: 0, tp_rank_of=None):
    """Every replica's pipeline against the reference: its losses, and every gradient and parameter."""
    replicas = sorted({replica_of(r) for r in range(len(per_rank))})
    for d in replicas:
        ranks = [r for r in range(len(per_rank)) if replica_of(r) == d]
        mine = [per_rank[r] for r in ranks]
        if tp_rank_of is not None:  # group the tp ranks of each pipeline rank, then merge their shards
            groups = {}
            for r, res in zip(ranks, mine):
                groups.setdefault(tuple(sorted(res["layout"])), []).append((tp_rank_of(r), res))
            mine = []
            for members in groups.values():
                members.sort(key=lambda m: m[0])
                losses = [m[1]["loss"] for m in members]
                assert all(x == losses[0] for x in losses), f"{what}: tp ranks report different losses {losses}"
                mine.append(_merge_tp([m[1] for m in members], members[0][1]["layout"]))
        assert_matches(mine, {**ref, "loss": ref["replica_loss"][d]}, f"{what}, replica {d}")


def _check_hosts(hosts_seen, n_per_host):
    """torchrun put consecutive ranks on one host, n_per_host each, on two different hosts."""
    by_host = [hosts_seen[i:i + n_per_host] for i in range(0, len(hosts_seen), n_per_host)]
    assert all(len(set(h)) == 1 for h in by_host) and len({h[0] for h in by_host}) == 2, hosts_seen


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs_2x2(tmp_path_factory):
    """_pipelines_2x2 on 2 test hosts x 2 ranks, once for the tests below."""
    tmp_path = tmp_path_factory.mktemp("pipe-hosts")
    with TestHosts(2) as hosts:
        out, procs = start_job(hosts, tmp_path, "test_pipeline_hosts:_pipelines_2x2")
        runs = [r["result"] for r in collect(hosts, tmp_path, out, procs, timeout=420)]
    _check_hosts(runs[0]["hosts"], 2)
    return runs


def test_receives_are_posted_early_on_groups_spanning_hosts(runs_2x2):
    """A tdx group spanning hosts sends through Gloo, which moves a message only once its receive is
    posted: the schedules post each receive one compute action ahead there, from their poster thread
    (Gloo writes to the socket in the caller), and right before its consumer, from the schedule's
    thread, on a group inside one host (shared memory)."""
    for r, run in enumerate(runs_2x2):
        assert run["posts_early"] == {"world": True, "pp": True, "dp": False}, (r, run["posts_early"])
        assert run["from_thread"] == {"pp": True, "dp": False}, (r, run["from_thread"])


@pytest.mark.parametrize("kind", KINDS)
def test_pp4_across_two_hosts_matches_unsplit_model(runs_2x2, kind):
    """Stages 0, 1 on one host, 2, 3 on the other (ZB-V: 8 stages in a V, the link crossed four times)."""
    n_stages = 8 if kind == "zbv" else 4
    ref = _reference(_parts(n_stages), _batch, nn.functional.cross_entropy)
    _check([r[("pp4", kind)] for r in runs_2x2], ref, f"pp=4 {kind}")


@pytest.mark.parametrize("kind", KINDS)
def test_pp2_across_hosts_x_dp2_inside_matches_unsplit_model(runs_2x2, kind):
    """DeviceMesh (pp=2, dp=2): our DDP in each stage for GPipe and 1F1B, averaged gradients for ZB-V."""
    n_stages = 4 if kind == "zbv" else 2
    ref = _reference(_parts(n_stages), _batch, nn.functional.cross_entropy, dp=2)
    _check([r[("pp2xdp2", kind)] for r in runs_2x2], ref, f"pp=2 x dp=2 {kind}", replica_of=lambda r: r % 2)


@pytest.mark.parametrize("kind", KINDS)
def test_pp2_across_hosts_x_tp2_inside_matches_unsplit_model(runs_2x2, kind):
    """DeviceMesh (pp=2, tp=2): transformer blocks split by Megatron TP inside a host, stages across."""
    n_stages = 4 if kind == "zbv" else 2
    ref = _reference(_tp_parts(n_stages), _tp_batch, nn.functional.mse_loss)
    _check([r[("pp2xtp2", kind)] for r in runs_2x2], ref, f"pp=2 x tp=2 {kind}", tp_rank_of=lambda r: r % 2)


def test_dp2_x_pp2_x_tp2_on_two_hosts_of_four_matches_unsplit_model(tmp_path):
    """The 3D mesh (pp=2 across the hosts; dp=2 and tp=2 inside each) on 2 test hosts x 4 ranks."""
    with TestHosts(2) as hosts:
        out, procs = start_job(hosts, tmp_path, "test_pipeline_hosts:_pipelines_3d", nproc_per_node=4)
        runs = [r["result"] for r in collect(hosts, tmp_path, out, procs, world_size=8, timeout=600)]
    _check_hosts(runs[0]["hosts"], 4)
    for kind in ("1f1b", "zbv"):
        n_stages = 4 if kind == "zbv" else 2
        ref = _reference(_tp_parts(n_stages), _tp_batch, nn.functional.mse_loss, dp=2)
        _check([r[kind] for r in runs], ref, f"dp x pp x tp {kind}", replica_of=lambda r: (r // 2) % 2,
               tp_rank_of=lambda r: r % 2)


@pytest.mark.soak
def test_bench_hosts_send_recv_against_the_raw_link():
    """`bench hosts -c send_recv` times stage-to-stage sends across the link for tdx, gloo and a plain TCP
    connection between the same two processes, each checked for the bytes received."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "torchdist_ext.bench", "hosts", "-c", "send_recv", "--backends",
                           "tdx,gloo,tcp", "--link", "1gbit", "--sizes", "64K,1M", "--repeats", "1", "--iters", "1"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=repo))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# send_recv: 2 hosts x 2 ranks, link 1gbit" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("64K", "1M"))]
    assert len(rows) == 2 and not any("WRONG" in r for r in rows), proc.stdout
    # size, 3 x (p50, p90), 2 x "a/b p90" against gloo, 2 against tcp, the bound, 3 x "%/% p90"
    assert all(len(r) == 1 + 6 + 4 + 2 + 1 + 6 for r in rows), proc.stdout
