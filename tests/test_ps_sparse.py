"""torchdist_ext.ps: an nn.Embedding(sparse=True) travels only the rows a batch touches; its training
equals the dense path and single-process training, and its bytes per step are counted."""
import torch

from _dist import run_ranks
from _ps_models import TwoTower, click_batches
from torchdist_ext import ps
from torchdist_ext.ps._protocol import CONTROL, HEADER

STEPS, BATCH, ROWS, DIM = 8, 16, 1000, 8
SPLIT = 1024  # bytes: the 1000x8 table (32 KB) is split by rows across both servers


def _loss(model, pairs, clicks):
    return torch.nn.functional.binary_cross_entropy_with_logits(model(pairs), clicks)


def _train(rank, world_size):
    out = {}
    for sparse in (True, False):
        cfg = ps.PSConfig(num_servers=2, mode="sync", split_bytes=SPLIT)
        if ps.is_server(cfg):
            server = ps.ParameterServer(TwoTower(ROWS, DIM, sparse), torch.optim.SGD, cfg, lr=0.5)
            server.run()
            out[sparse] = {n: p.detach().clone() for n, p in server.named_parameters()}
            continue
        i, n = rank - 2, world_size - 2
        model = ps.Worker(TwoTower(ROWS, DIM, sparse, seed=rank), cfg)
        opt = ps.PushOptimizer(model)
        start = dict(model.traffic)
        for pairs, clicks in click_batches(STEPS, BATCH, ROWS):
            opt.zero_grad()
            _loss(model, pairs.chunk(n)[i], clicks.chunk(n)[i]).backward()
            opt.step()
        model.close()
        out[sparse] = {k: (v - start[k]) / STEPS for k, v in model.traffic.items()}
        out[sparse]["params"] = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return out


def _expected_sparse_bytes(pairs, servers_rows, dense_numel):
    """What a worker sends and receives in one step: per server holding touched rows, a ROWS request
    (control 8 x CONTROL B + 8 B per id) and the rows (4 B x DIM each); per server a PUSH (control, the
    dense gradient, the int64 counts and ids, the gradient rows) and a REPLY (HEADER words + parameters)."""
    ids = torch.unique(pairs)
    sent = received = 0
    for k, (lo, hi) in enumerate(servers_rows):
        mine = ids[(ids >= lo) & (ids < hi)]
        pushed = mine[mine != 0]  # the padding row has no gradient
        if mine.numel():
            sent += 8 * CONTROL + 8 * mine.numel()
            received += 4 * DIM * mine.numel()
        sent += 8 * CONTROL + 4 * dense_numel[k] + 8 * (1 + pushed.numel()) + 4 * DIM * pushed.numel()
        received += 4 * (HEADER + dense_numel[k])
    return sent, received


def test_sparse_embedding_moves_touched_rows_only_and_equals_dense_and_one_process():
    results = run_ranks(_train, 4)
    ref = TwoTower(ROWS, DIM, sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for pairs, clicks in click_batches(STEPS, BATCH, ROWS):
        opt.zero_grad()
        _loss(ref, pairs, clicks).backward()
        opt.step()
    table = {sparse: torch.cat([results[0][sparse]["table.weight[0:500]"],
                                results[1][sparse]["table.weight[500:1000]"]]) for sparse in (True, False)}
    torch.testing.assert_close(table[True], ref.table.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table[True], table[False], rtol=1e-5, atol=1e-6)
    assert not torch.equal(table[True], TwoTower(ROWS, DIM).table.weight)  # it did train
    for r in (2, 3):
        for name in ("head.weight", "head.bias"):
            torch.testing.assert_close(results[r][True]["params"][name], getattr(ref.head, name[5:]).detach(),
                                       rtol=1e-5, atol=1e-6)
        assert "table.weight" not in results[r][True]["params"]  # a sparse worker keeps no copy of the table
    # the head (9 floats) is assigned whole to the server with fewer bytes: server 0 (both hold 16 KB of table)
    dense_numel = [DIM + 1, 0]
    want = [0, 0]
    for pairs, _ in click_batches(STEPS, BATCH, ROWS):
        sent, received = _expected_sparse_bytes(pairs.chunk(2)[0], [(0, 500), (500, 1000)], dense_numel)
        want[0], want[1] = want[0] + sent / STEPS, want[1] + received / STEPS
    assert results[2][True]["sent"] == want[0] and results[2][True]["received"] == want[1]
    dense = results[2][False]
    assert dense["sent"] == 2 * 8 * CONTROL + 4 * (ROWS * DIM + DIM + 1)  # every row, every step
    assert dense["received"] == 4 * (2 * HEADER + ROWS * DIM + DIM + 1)
    print(f"bytes per worker step: sparse {results[2][True]['sent']:.0f} sent, {results[2][True]['received']:.0f} "
          f"received; dense {dense['sent']:.0f} sent, {dense['received']:.0f} received")
    assert results[2][True]["sent"] * 20 < dense["sent"]
