"""Pipeline schedules as data, checked without processes: every rank's action list is simulated
against the others (torchdist_ext.pipeline.simulate) and also checked directly here."""
import itertools
from collections import Counter

import pytest
import torch
from torch import nn

from torchdist_ext.pipeline import Action, ScheduleError, format_schedule, parse_schedule, simulate, split_sequential
from torchdist_ext.pipeline import _orders, _zb_orders
from torchdist_ext.pipeline._actions import BACKWARD, BACKWARD_INPUT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F
from torchdist_ext.pipeline._lower import add_communication, post_at_producer
from torchdist_ext.pipeline.split import balance

SINGLE = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]
INTERLEAVED = [(1, 2, 3), (2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 4, 9)]


def _schedules():
    for p, m in SINGLE:
        yield f"gpipe-p{p}-m{m}", _orders.gpipe(p, m), p, m, 1
        yield f"1f1b-p{p}-m{m}", _orders.one_f_one_b(p, m), p, m, 1
    for p, v, m in INTERLEAVED:
        yield f"interleaved-p{p}-v{v}-m{m}", _orders.interleaved_1f1b(p, m, v), p, m, v


ALL = list(_schedules())


def _f_before_b(actions_by_rank):
    for rank, acts in actions_by_rank.items():
        done = set()
        for a in acts:
            if a.type == FORWARD:
                done.add((a.stage, a.microbatch))
            elif a.type == BACKWARD:
                assert (a.stage, a.microbatch) in done, f"rank {rank}: {a} before its forward"


def _sends_matched(actions_by_rank):
    sends, recvs = Counter(), Counter()
    for acts in actions_by_rank.values():
        for a in acts:
            if a.type == SEND_F:
                sends[("F", a.stage + 1, a.microbatch)] += 1
            elif a.type == SEND_B:
                sends[("B", a.stage - 1, a.microbatch)] += 1
            elif a.type == RECV_F:
                recvs[("F", a.stage, a.microbatch)] += 1
            elif a.type == RECV_B:
                recvs[("B", a.stage, a.microbatch)] += 1
    assert sends == recvs, f"unmatched: sends-recvs {sends - recvs}, recvs-sends {recvs - sends}"
    return sum(sends.values())


def _alive(actions_by_rank):
    out = {}
    for rank, acts in actions_by_rank.items():
        alive = peak = 0
        for a in acts:
            alive += (a.type == FORWARD) - (a.type == BACKWARD)
            peak = max(peak, alive)
        out[rank] = peak
    return out


@pytest.mark.parametrize("prefetch", [True, False], ids=["recv-early", "recv-late"])
@pytest.mark.parametrize("name,compute,p,m,v", ALL, ids=[s[0] for s in ALL])
def test_schedule_is_consistent(name, compute, p, m, v, prefetch):
    stages = p * v
    lowered = add_communication(compute, stages, prefetch=prefetch)
    _f_before_b(lowered)
    n_msgs = _sends_matched(lowered)
    # one activation and one gradient message per micro-batch per boundary between ranks
    assert n_msgs == (2 * m * (stages - 1) if p > 1 else 0) or p == 1
    res = simulate(lowered, stages, m, num_ranks=p)  # raises on a cycle of waits
    assert res.max_alive == _alive(lowered)
    # every stage's compute appears exactly once per micro-batch
    counts = Counter((a.stage, a.type, a.microbatch) for acts in compute.values() for a in acts)
    assert set(counts.values()) == {1} and len(counts) == 2 * stages * m


@pytest.mark.parametrize("p,m", SINGLE)
def test_1f1b_keeps_at_most_num_stages_microbatches_alive(p, m):
    alive = _alive(_orders.one_f_one_b(p, m))
    for rank, peak in alive.items():
        assert peak <= p and peak == min(p - rank, m), alive
    assert _alive(_orders.gpipe(p, m)) == {r: m for r in range(p)}  # GPipe keeps all of them


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 16)])
def test_bubble_matches_theory(p, m):
    for order in (_orders.gpipe, _orders.one_f_one_b):
        res = simulate(add_communication(order(p, m), p), p, m)
        assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # interleaving v stages per rank divides the bubble's share by about v
    res = simulate(add_communication(_orders.interleaved_1f1b(p, m - m % p or p, 2), 2 * p), 2 * p, m - m % p or p, p)
    mm = m - m % p or p
    assert res.bubble_fraction == pytest.approx((p - 1) / (2 * mm + p - 1))


def test_receive_placement_early_and_late():
    """Early: each receive is posted one compute action ahead; late: right before its consumer."""
    compute = _orders.one_f_one_b(2, 3)
    early, late = add_communication(compute, 2), add_communication(compute, 2, prefetch=False)
    assert format_schedule(early).splitlines()[1] == "rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 " \
                                                     "1SEND_B1 1F2 1B2 1SEND_B2"
    assert format_schedule(late).splitlines()[1] == "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 " \
                                                    "1RECV_F2 1F2 1B2 1SEND_B2"
    for acts in late.values():
        for i, a in enumerate(acts):
            if a.type in (RECV_F, RECV_B):
                consumer = acts[i + 1]
                assert (consumer.stage, consumer.microbatch) == (a.stage, a.microbatch)
                assert consumer.type == (FORWARD if a.type == RECV_F else BACKWARD)


def _moved(name, p, m):
    if name == "zbv":
        compute, placement = _zb_orders.zbv(p, m), _orders.v_placement(p)
    elif name == "dualpipev":
        compute, placement = _zb_orders.dualpipev(p, m), _orders.v_placement(p)
    else:
        compute, placement = _orders.one_f_one_b(p, m), _orders.loop_placement(p)
    stages = len(placement)
    lowered = add_communication(compute, stages)
    played = simulate(lowered, stages, m, p, placement=placement)
    return lowered, played, post_at_producer(lowered, played.timeline), stages, placement


@pytest.mark.parametrize("name,p,m", [("zbv", 2, 4), ("zbv", 4, 8), ("dualpipev", 2, 8), ("1f1b", 3, 5)])
def test_receives_posted_when_their_sender_starts(name, p, m):
    """post_at_producer moves each receive up to the compute action running when its sender starts the
    producing computation (unit-cost timeline), never later than one ahead of its consumer; the
    schedule's compute order, its sends and its simulated timeline stay as they were."""
    lowered, played, moved, stages, placement = _moved(name, p, m)
    again = simulate(moved, stages, m, p, placement=placement)  # consistent: flows in order, no cycle
    assert again.timeline == played.timeline
    start = {a: t0 for spans in played.timeline.values() for a, t0, _ in spans}
    for rank, acts in moved.items():
        assert [a for a in acts if a.type not in (RECV_F, RECV_B)] == \
            [a for a in lowered[rank] if a.type not in (RECV_F, RECV_B)]
        ends = [t1 for _, _, t1 in played.timeline[rank]]
        for i, a in enumerate(acts):
            if a.type not in (RECV_F, RECV_B):
                continue
            now, was = _before(acts, i), _before(lowered[rank], lowered[rank].index(a))
            sender = [t for x, t in start.items() if x.microbatch == a.microbatch and
                      ((a.type == RECV_F and x == Action(a.stage - 1, FORWARD, a.microbatch)) or
                       (a.type == RECV_B and x.stage == a.stage + 1 and x.type in (BACKWARD, BACKWARD_INPUT)))]
            assert now <= was, (rank, a)
            # posted once every compute action before it ends by the time the sender starts (or left in place)
            assert now == was or all(e <= sender[0] for e in ends[:now]), (rank, a, now, was)


def _before(acts, i):
    return sum(1 for a in acts[:i] if a.type not in (RECV_F, RECV_B, SEND_F, SEND_B))


def test_zbv_receive_posted_before_the_rank_falls_behind():
    """ZB-V, 2 ranks, m = 4: rank 1 posts stage 1's receive of micro-batch 2 before its 1F1 (rank 0 starts
    0F2 then), where one compute action ahead of 1F2 put it after 2W0, three actions after the send."""
    lowered, _, moved, _, _ = _moved("zbv", 2, 4)
    recv, first = Action(1, RECV_F, 2), Action(1, FORWARD, 1)
    assert moved[1].index(recv) < moved[1].index(first) < lowered[1].index(recv)


def test_forward_only_schedule():
    lowered = add_communication(_orders.forward_only(3, 4), 3)
    simulate(lowered, 3, 4, with_backward=False)
    assert all(a.type in (FORWARD, SEND_F, RECV_F) for acts in lowered.values() for a in acts)


def test_format_and_parse_round_trip():
    lowered = add_communication(_orders.one_f_one_b(2, 3), 2)
    text = format_schedule(lowered)
    assert text.splitlines()[0].startswith("rank 0: 0F0 0SEND_F0")
    assert parse_schedule(text) == lowered
    assert Action.parse("12RECV_B3") == Action(12, RECV_B, 3)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("0X1")


# --- the checker rejects broken schedules -------------------------------------------------------

def _p(text):
    return parse_schedule(text)


def test_simulate_detects_cycle_of_waits():
    # rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 0's activations
    bad = _p("rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="produces 0SEND_F0|cycle"):
        simulate(bad, 2, 1)
    bad = _p("rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    bad[0] = [Action.parse(t) for t in "0RECV_B0 0B0 0F0 0SEND_F0".split()]
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate(bad, 2, 1)
    # rank 0 runs stage 2 before sending stage 0's output, which stage 2's input depends on via rank 1
    bad = _p("rank 0: 0F0 2RECV_F0 2F0 2SEND_F0 0SEND_F0 2RECV_B0 2B0 2SEND_B0 0RECV_B0 0B0\n"
             "rank 1: 1RECV_F0 1F0 1SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 1RECV_B0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="cycle"):
        simulate(bad, 4, 1, num_ranks=2)


def test_simulate_detects_unmatched_and_reordered_messages():
    good = add_communication(_orders.gpipe(2, 2), 2)
    missing = {0: good[0], 1: [a for a in good[1] if a != Action(1, SEND_B, 1)]}
    with pytest.raises(ScheduleError, match="never follows|every send"):
        simulate(missing, 2, 2)
    reordered = {0: list(good[0]), 1: list(good[1])}
    i, j = reordered[1].index(Action(1, RECV_F, 0)), reordered[1].index(Action(1, RECV_F, 1))
    reordered[1][i], reordered[1][j] = reordered[1][j], reordered[1][i]
    with pytest.raises(ScheduleError, match="order"):
        simulate(reordered, 2, 2)
    wrong_rank = {0: [Action(1, FORWARD, 0)], 1: []}
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        simulate(wrong_rank, 2, 1)


def test_interleaved_needs_multiple_of_ranks():
    with pytest.raises(ValueError, match="multiple of"):
        _orders.interleaved_1f1b(4, 6, 2)


# --- splitting an nn.Sequential ----------------------------------------------------------------

def test_balance_is_optimal():
    for costs in ([5, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3, 3], [0, 0, 7, 0]):
        for k in range(1, len(costs) + 1):
            sizes = balance(costs, k)
            assert sum(sizes) == len(costs) and len(sizes) == k and min(sizes) >= 1
            best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (len(costs),)))
                       for cuts in itertools.combinations(range(1, len(costs)), k - 1))
            starts = [sum(sizes[:i]) for i in range(k + 1)]
            assert max(sum(costs[starts[i]:starts[i + 1]]) for i in range(k)) == best


def test_split_sequential_by_params_and_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    stages = split_sequential(model, 2)  # parameters 576, 0, 4160, 4160, 520: the best cut is after layer 2
    assert [list(s._modules) for s in stages] == [["0", "1", "2"], ["3", "4"]]
    assert stages[0][0] is model[0]  # shared, not copied
    x = torch.randn(4, 8)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, model(x))
    timed = split_sequential(model, 3, by="time", example_input=x, repeats=2)
    assert sum(len(s) for s in timed) == 5 and all(len(s) >= 1 for s in timed)
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind
    with pytest.raises(ValueError, match="from 1 to the number of layers"):
        split_sequential(model, 6)
    with pytest.raises(ValueError, match="example_input"):
        split_sequential(model, 2, by="time")
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_sequential(nn.Linear(2, 2), 1)
