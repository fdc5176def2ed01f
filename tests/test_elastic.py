"""Elastic recovery on tdx: the failure notice, shrinking a group in place, and ElasticDDP.

The notice tests prove the peers read the failing rank's own notice (its reason appears in their
error, which a dead process cannot tell them); how fast they raise is measured by
benchmarks/elastic_bench.py, not asserted here. The 50-run count is the soak test
(``python -m pytest -m soak tests/test_elastic.py``).
"""
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from torchdist_ext._backend import spans_hosts

PG_TIMEOUT = 30.0
NOTICE_MODES = ["excepthook", "sys_exit", "sigterm"]


def _fail(mode):
    """Fails this rank the way `mode` says (the victim's side of the notice tests)."""
    if mode == "excepthook":
        try:
            raise ValueError("boom")
        except ValueError:
            sys.excepthook(*sys.exc_info())  # what the interpreter does with an uncaught exception
        time.sleep(1.0)  # still alive: only its notice can tell the peers why
    elif mode == "sys_exit":
        try:
            raise ValueError("boom")
        except ValueError:
            sys.exit(3)  # torch.multiprocessing's pattern for a worker that raised
    elif mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(PG_TIMEOUT)
    else:
        raise ValueError(mode)


EXPECTED_REASON = {"excepthook": "raised ValueError: boom", "sys_exit": "called sys.exit(3) while handling "
                   "ValueError: boom", "sigterm": "killed by signal SIGTERM"}


def _notice_body(rank, ws, mode, victim):
    dist.all_reduce(torch.ones(8))
    if rank == victim:
        time.sleep(0.2)
        _fail(mode)
        return None
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except dist.DistBackendError as e:
        return str(e)
    raise AssertionError(f"all_reduce succeeded although rank {victim} failed")


def _check_notice(out, ws, mode, victim):
    for r in range(ws):
        if r == victim:
            continue
        status, msg = out[r]
        assert status == "ok", f"rank {r}: {status}: {msg}"
        assert f"rank {victim} (pid " in msg and EXPECTED_REASON[mode] in msg, msg


@pytest.mark.parametrize("mode", NOTICE_MODES)
def test_failing_rank_announces_itself_with_its_reason(mode):
    ws, victim = 3, 1
    out = run_ranks(_notice_body, ws, mode, victim, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=3 * PG_TIMEOUT)
    _check_notice(out, ws, mode, victim)


@pytest.mark.soak
def test_notice_50_of_50_runs():
    named = 0
    for i in range(50):
        mode = NOTICE_MODES[i % len(NOTICE_MODES)]
        out = run_ranks(_notice_body, 2, mode, 1, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                        timeout=3 * PG_TIMEOUT)
        _check_notice(out, 2, mode, 1)
        named += 1
    assert named == 50


def _collective_error_body(rank, ws):
    from torchdist_ext import elastic

    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(8))
    if rank == 2:
        _fail("sys_exit")
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(8))
        except dist.DistBackendError as e:
            gone = elastic.gone_ranks()
            sys.excepthook(type(e), e, e.__traceback__)  # the collective's error, uncaught
            time.sleep(1.0)
            return sorted(gone)
        raise AssertionError("all_reduce succeeded although rank 2 failed")
    time.sleep(0.3)
    try:
        dist.all_reduce(torch.ones(8), group=pair)
    except dist.DistBackendError as e:
        return str(e)
    raise AssertionError("all_reduce over ranks 0 and 1 succeeded although rank 1 failed")


def test_an_error_from_a_collective_names_the_rank_where_the_failure_began():
    out = run_ranks(_collective_error_body, 3, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=3 * PG_TIMEOUT)
    assert out[1] == ("ok", [2]), out[1]  # rank 1's own collective failed, yet only rank 2 is gone
    status, msg = out[0]
    assert status == "ok", msg
    assert "rank 1 (pid " in msg and "rank 2" in msg and "ValueError: boom" in msg, msg


def _fork_body(rank, ws):
    from torchdist_ext import elastic

    dist.all_reduce(torch.ones(8))
    if rank == 1:
        pid = os.fork()  # a DataLoader worker, say: it maps the group's segments too
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    dist.barrier()
    t = torch.ones(8)
    dist.all_reduce(t)
    return elastic.gone_ranks(), t.tolist()


def test_a_child_forked_from_a_rank_that_fails_does_not_mark_the_rank():
    out = run_ranks(_fork_body, 2, pg_timeout=PG_TIMEOUT, timeout=3 * PG_TIMEOUT)
    assert out == [({}, [2.0] * 8)] * 2, out


# --- shrinking ---------------------------------------------------------------------------------

def _value(rank, n=1000):
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank


def _check_new_group(group, survivors):
    """Collectives over the shrunk `group` (whose members are the old ranks `survivors`)."""
    me, ws = group.rank(), group.size()
    assert ws == len(survivors)
    t = _value(survivors[me])
    dist.all_reduce(t, group=group)
    ref = _value(survivors[0])
    for r in survivors[1:]:
        ref = ref + _value(r)
    assert torch.equal(t, ref)
    got = [torch.empty(1000) for _ in range(ws)]
    dist.all_gather(got, _value(survivors[me]), group=group)
    assert all(torch.equal(g, _value(r)) for g, r in zip(got, survivors))
    b = _value(survivors[me])
    dist.broadcast(b, src=dist.get_global_rank(group, ws - 1), group=group)
    assert torch.equal(b, _value(survivors[-1]))


def _shrink_after_death_body(rank, ws, victim):
    from torchdist_ext import elastic

    dist.all_reduce(torch.ones(8))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(dist.DistBackendError, match=f"rank {victim} \\(pid"):
        dist.all_reduce(torch.ones(1 << 16))
    gone = elastic.gone_ranks()
    assert list(gone) == [victim], gone
    new = dist.shrink_group([victim], shrink_flags=dist.SHRINK_ABORT if hasattr(dist, "SHRINK_ABORT") else 1)
    assert dist.get_world_size() == ws - 1 and new.size() == ws - 1
    survivors = [r for r in range(ws) if r != victim]
    assert new.rank() == survivors.index(rank)
    _check_new_group(new, survivors)
    return new.rank()


def test_shrink_group_after_a_rank_is_killed():
    ws, victim = 4, 1
    out = run_ranks(_shrink_after_death_body, ws, victim, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=3 * PG_TIMEOUT)
    assert out[victim][0] == "died", out[victim]
    assert [out[r] for r in (0, 2, 3)] == [("ok", 0), ("ok", 1), ("ok", 2)], out


def _two_hosts(rank):
    """Ranks 0-1 on simulated host A, 2-3 on host B (tdx's multi-host mode: Gloo between them)."""
    return {"TDX_NODE_ID": f"simhost{rank // 2}"}


def _shrink_across_hosts_body(rank, ws, victim):
    from torchdist_ext import elastic

    dist.all_reduce(torch.ones(8))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(dist.DistBackendError):
        dist.all_reduce(torch.ones(1 << 16))
    gone = elastic.gone_ranks()  # the other host's ranks learn it from the victim's host mate
    assert list(gone) == [victim] and f"rank {victim} (pid" in gone[victim], gone
    new = dist.shrink_group([victim], shrink_flags=1)  # SHRINK_ABORT
    survivors = [r for r in range(ws) if r != victim]
    assert dist.get_world_size() == ws - 1 and new.rank() == survivors.index(rank)
    assert spans_hosts(new)  # a survivor on each host: its p2p still goes through Gloo (receives posted early)
    _check_new_group(new, survivors)
    return new.rank()


@pytest.mark.parametrize("victim", [1, 2])
def test_shrink_group_across_hosts_after_a_rank_is_killed(victim):
    """2 simulated hosts x 2 ranks: the host parts shrink in shared memory, Gloo is re-formed."""
    out = run_ranks(_shrink_across_hosts_body, 4, victim, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=3 * PG_TIMEOUT, rank_env=_two_hosts)
    assert out[victim][0] == "died", out[victim]
    assert [out[r] for r in range(4) if r != victim] == [("ok", 0), ("ok", 1), ("ok", 2)], out


def _shrink_abort_body(rank, ws):
    from torchdist_ext import elastic

    dist.all_reduce(torch.ones(8))
    if rank == ws - 1:  # alive, but never joins another collective of the old group
        time.sleep(3.0)
        return "excluded"
    work = dist.all_reduce(torch.ones(8), async_op=True)  # waits for the excluded rank
    time.sleep(0.2)
    two_hosts = "TDX_NODE_ID" in os.environ
    assert spans_hosts(dist.group.WORLD) == two_hosts
    new = elastic.shrink_group([ws - 1], shrink_flags=elastic.SHRINK_ABORT)
    # Interrupted by this rank's own abort, or (when the other survivor's shrink marked the excluded rank
    # first) by that exclusion: either way the operation ends with a reason instead of waiting.
    with pytest.raises(dist.DistBackendError, match="abort|excluded from the group by its survivors"):
        work.wait()
    _check_new_group(new, list(range(ws - 1)))
    assert not spans_hosts(new)  # the excluded rank was the other host's only one
    return new.size()


@pytest.mark.parametrize("hosts", [1, 2], ids=["one-host", "two-hosts"])
def test_shrink_abort_interrupts_an_operation_in_flight_and_excludes_a_live_rank(hosts):
    """On two simulated hosts ([0, 1] and [2]) the operation in flight waits in Gloo for rank 2."""
    out = run_ranks(_shrink_abort_body, 3, pg_timeout=PG_TIMEOUT, timeout=3 * PG_TIMEOUT,
                    rank_env=_two_hosts if hosts == 2 else None)
    assert out == [2, 2, "excluded"]


def _p2p_on_a_shrinking_peer_body(rank, ws):
    from torchdist_ext import elastic

    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        # Rank 1 waits on the dead rank 2; rank 0 on rank 1, which is alive and does not send.
        dist.recv(torch.empty(4), src=rank + 1)
    except dist.DistBackendError as error:
        why = str(error)
    elastic.shrink_group([2], shrink_flags=elastic.SHRINK_ABORT)
    return why


def test_a_p2p_operation_waiting_on_a_peer_that_shrinks_the_group_fails_naming_it():
    """Without the mark that SHRINK_ABORT leaves in the old group, rank 0 would wait for the
    timeout (a pipeline stage two stages before a dead one)."""
    out = run_ranks(_p2p_on_a_shrinking_peer_body, 3, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=3 * PG_TIMEOUT)
    assert out[2][0] == "died", out[2]
    assert out[1][0] == "ok" and "rank 2 (pid" in out[1][1] and "exited" in out[1][1], out[1]
    assert out[0][0] == "ok" and "rank 1 (pid" in out[0][1] and "aborted the group" in out[0][1], out[0]


def _shrink_errors_body(rank, ws):
    from torchdist_ext import elastic

    with pytest.raises(ValueError, match="out of range"):
        dist.group.WORLD._get_backend(torch.device("cpu")).shrink([ws], 0)
    with pytest.raises(ValueError, match="excludes itself"):
        dist.group.WORLD._get_backend(torch.device("cpu")).shrink([rank], 0)
    with pytest.raises(ValueError, match="unknown shrink_flags"):
        dist.group.WORLD._get_backend(torch.device("cpu")).shrink([1 - rank], 4)
    assert elastic.gone_ranks() == {}
    return True


def test_shrink_rejects_bad_arguments():
    assert run_ranks(_shrink_errors_body, 2, pg_timeout=PG_TIMEOUT) == [True, True]
