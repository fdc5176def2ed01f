"""Zero-bubble orders without processes: ZB-V and DualPipeV equal torch's orders, ZB-H1 reaches the bubble
of Qi et al. with 1F1B's activation memory, and the simulator checks I/W actions."""
import types

import pytest

from torchdist_ext.pipeline import Action, ScheduleError, format_schedule, parse_schedule, simulate
from torchdist_ext.pipeline import _orders, _zb_orders
from torchdist_ext.pipeline._lower import add_communication


def _sim(order, p, m, placement=None):
    stages = len(placement) if placement else sum(len({a.stage for a in acts}) for acts in order.values())
    return simulate(add_communication(order, stages), stages, m, num_ranks=p, placement=placement)


def _torch_order(name, p, m):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, name, None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {name}._calculate_single_rank_operations")
    ns = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, _num_stages=2 * p)
    out = {}
    for r in range(p):
        acts = []
        for a in cls._calculate_single_rank_operations(ns, r):
            if a is not None:  # DualPipeV's overlapped pairs run their two actions in turn
                acts += [str(x) for x in a.sub_actions] if a.sub_actions else [str(a)]
        out[r] = acts
    return out


@pytest.mark.parametrize("p,m", [(1, 4), (2, 1), (2, 3), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_zbv_is_torchs_order(p, m):
    ours = _zb_orders.zbv(p, m)
    assert {r: [str(a) for a in acts] for r, acts in ours.items()} == _torch_order("ScheduleZBVZeroBubble", p, m)
    res = _sim(ours, p, m, _orders.v_placement(p))
    assert res.bubble_fraction < _sim(_orders.one_f_one_b(2 * p, m), 2 * p, m).bubble_fraction or p == 1


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 8), (4, 8), (4, 16)])
def test_dualpipev_is_torchs_order(p, m):
    ours = _zb_orders.dualpipev(p, m)
    assert {r: [str(a) for a in acts] for r, acts in ours.items()} == _torch_order("ScheduleDualPipeV", p, m)
    _sim(ours, p, m, _orders.v_placement(p))  # consistent, no cycle of waits
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        _zb_orders.dualpipev(p, 2 * p - 1)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 3), (3, 16), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_bubble_and_memory(p, m):
    """ZB-H1 (F, I, W of unit cost): bubble (p-1)/(3m+p-1), against 1F1B's 3(p-1)/(3m+3(p-1)), with no
    rank holding more micro-batches (forward done, W not yet) than 1F1B's first rank."""
    zb = _sim(_zb_orders.zb_h1(p, m), p, m)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert _sim(_orders.one_f_one_b(p, m), p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert max(zb.max_alive.values()) <= min(p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_interleaved_zero_bubble_beats_interleaved_1f1b(p, m):
    zb = _sim(_zb_orders.interleaved_zero_bubble(p, m, 2), p, m)
    base = _sim(_orders.interleaved_1f1b(p, m, 2), p, m)
    assert zb.bubble_fraction < base.bubble_fraction


def test_simulator_checks_split_backwards():
    good = parse_schedule("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1I0 1W0")
    simulate(add_communication(good, 2), 2, 1)
    w_first = parse_schedule("rank 0: 0F0 0W0 0I0\nrank 1: 1F0 1I0 1W0")
    with pytest.raises(ScheduleError, match="0W0 .* runs before its I"):
        simulate(add_communication(w_first, 2), 2, 1)
    no_w = parse_schedule("rank 0: 0F0 0I0\nrank 1: 1F0 1I0 1W0")
    with pytest.raises(ScheduleError, match="W of micro-batch 0 0 times"):
        simulate(add_communication(no_w, 2), 2, 1)
    both = parse_schedule("rank 0: 0F0 0B0 0I0 0W0\nrank 1: 1F0 1B0")
    with pytest.raises(ScheduleError, match="B of micro-batch 0 1 times .expected 0"):
        simulate(add_communication(both, 2), 2, 1)


def test_schedule_text_round_trip_and_errors():
    text = "rank 0: 0F0 0I0 0W0  # comment\n\nrank 1: 1F0, 1I0, 1W0"
    parsed = parse_schedule(text)
    assert parsed[1] == [Action.parse("1F0"), Action.parse("1I0"), Action.parse("1W0")]
    assert parse_schedule(format_schedule(parsed)) == parsed
    with pytest.raises(ValueError, match="should read 'rank <r>: <action>"):
        parse_schedule("0: 0F0")
    with pytest.raises(ValueError, match="cannot parse schedule action '0X0'"):
        parse_schedule("rank 0: 0X0")
    with pytest.raises(ValueError, match="rank 0 appears twice"):
        parse_schedule("rank 0: 0F0\nrank 0: 0B0")


def test_unit_costs_and_measured_costs():
    """Costs per action: the simulator's bubble follows them (W twice as long as F leaves ZB-H1 a bubble)."""
    order = _zb_orders.zb_h1(2, 4)
    even = _sim(order, 2, 4)
    costly_w = simulate(add_communication(order, 2), 2, 4, cost=lambda r, a: 2.0 if a.type.value == "W" else 1.0)
    assert costly_w.busy[0] == 4 * 4 and even.busy[0] == 3 * 4
    assert all(end - start == (2.0 if a.type.value == "W" else 1.0)
               for acts in costly_w.timeline.values() for a, start, end in acts)


def test_custom_schedule_text_is_checked():
    from torchdist_ext.pipeline.zero_bubble import _parse_custom

    given = _parse_custom("rank 0: 0F0 0I0 0W0\nrank 1: 1F0 1I0 1W0", 2, 2)
    assert [str(a) for a in given[1]] == ["1F0", "1I0", "1W0"]
    assert _parse_custom({0: ["0F0", "0B0"]}, 1, 1)[0] == [Action.parse("0F0"), Action.parse("0B0")]
    with pytest.raises(ScheduleError, match="lines for ranks \\[0\\], but the group has 2 ranks"):
        _parse_custom("rank 0: 0F0 0B0", 2, 2)
    with pytest.raises(ScheduleError, match="communication actions \\['0SEND_F0'\\]"):
        _parse_custom("rank 0: 0F0 0SEND_F0\nrank 1: 1F0", 2, 2)
    with pytest.raises(ScheduleError, match="beyond the pipeline's 2"):
        _parse_custom("rank 0: 0F0 5F0\nrank 1: 1F0", 2, 2)
    with pytest.raises(TypeError, match="schedule must be text or a dict"):
        _parse_custom(3, 1, 1)
