"""tdx's flight recorder (issue 20): torch's layout, torch's analyzer, a dump when a call fails.

The recorder is read per rank with torchdist_ext.fr_trace.dump_fr_trace(); the reference layout is
torch's own, from a gloo group in the same process (torch records gloo's calls by default).
"""
import os
import pickle
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from _dist import run_ranks

ON = {"TORCH_FR_BUFFER_SIZE": "64"}


def _calls_body(rank, ws):
    from torchdist_ext import fr_trace

    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    out = torch.empty(2 * ws, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.ones(2, dtype=torch.bfloat16))
    if rank == 0:
        dist.send(torch.ones(3), ws - 1)
    elif rank == ws - 1:
        dist.recv(torch.empty(3), 0)
    tail = dist.new_group([1, ws - 1], group_desc="tail")
    if rank in (1, ws - 1):
        dist.broadcast(t, 1, group=tail)
    torch.ops.tdx.all_reduce_(t)
    dist.all_reduce(t, async_op=True).wait()
    # torch's own recorder, filled by a gloo group: the reference layout.
    gloo = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(1), group=gloo)
    torch_dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return {
        "enabled": fr_trace.enabled(),
        "dump": pickle.loads(fr_trace.dump_fr_trace()),
        "active": pickle.loads(fr_trace.dump_fr_trace(onlyActive=True)),
        "json": fr_trace.dump_fr_trace_json(),
        "torch": torch_dump,
    }


def test_records_every_call_in_torchs_layout():
    ws = 3
    results = run_ranks(_calls_body, ws, env=ON)
    for rank, res in enumerate(results):
        assert res["enabled"]
        dump, ref = res["dump"], res["torch"]
        assert set(dump) == set(ref) and dump["version"] == ref["version"]
        ref_entry = next(e for e in ref["entries"] if e["profiling_name"] == "gloo:all_reduce")
        tdx = [e for e in dump["entries"]]
        assert tdx and all(set(e) == set(ref_entry) for e in tdx), (set(tdx[0]) ^ set(ref_entry))
        names = [e["profiling_name"] for e in tdx]
        expected = ["tdx:all_reduce", "tdx:_all_gather_base"]
        expected += {0: [f"tdx:send 0->{ws - 1}"], ws - 1: [f"tdx:recv {ws - 1}<-0"]}.get(rank, [])
        expected += ["tdx:broadcast"] if rank in (1, ws - 1) else []
        expected += ["tdx:all_reduce", "tdx:all_reduce"]  # the direct op, then the async call
        assert names == expected
        default = [e for e in tdx if e["process_group"][1] == "default_pg"]
        assert [e["collective_seq_id"] for e in default if not e["is_p2p"]] == [1, 2, 3, 4]
        assert all(e["state"] == "completed" and e["retired"] for e in tdx)
        gather = tdx[1]
        assert gather["input_sizes"] == [[2]] and gather["output_sizes"] == [[2 * ws]]
        assert gather["input_dtypes"] == ["BFloat16"] == gather["output_dtypes"]
        # The caller's stack reaches this file's function.
        assert any(f["name"] == "_calls_body" for f in tdx[0]["frames"])
        # The group's global ranks, as the analyzer matches them across ranks.
        groups = {c["desc"]: c["ranks"] for c in dump["pg_config"].values()}
        assert groups["default_pg"] == str(list(range(ws)))
        assert groups.get("tail") == (str([1, ws - 1]) if rank in (1, ws - 1) else None)
        status = dump["pg_status"][str(tdx[0]["pg_id"])]
        assert status["last_enqueued_collective"] == status["last_completed_collective"] == 4
        assert res["active"]["entries"] == []
        assert b'"profiling_name": "tdx:all_reduce"' in res["json"]


def _off_body(rank, ws):
    from torchdist_ext import fr_trace

    dist.all_reduce(torch.ones(2))
    return fr_trace.enabled(), pickle.loads(fr_trace.dump_fr_trace())["entries"]


def test_off_unless_asked():
    for enabled, entries in run_ranks(_off_body, 2, env={"TORCH_FR_BUFFER_SIZE": ""}):
        assert not enabled and entries == []


def _ring_body(rank, ws):
    from torchdist_ext import fr_trace

    for i in range(6):
        dist.all_reduce(torch.full((i + 1,), 1.0))
    return pickle.loads(fr_trace.dump_fr_trace(includeStackTraces=False))["entries"]


def test_keeps_the_last_entries_in_order():
    for entries in run_ranks(_ring_body, 2, env={"TORCH_FR_BUFFER_SIZE": "4"}):
        assert [e["record_id"] for e in entries] == [2, 3, 4, 5]
        assert [e["input_sizes"] for e in entries] == [[[3]], [[4]], [[5]], [[6]]]
        assert all("frames" not in e for e in entries)


def _desync_body(rank, ws):
    from torchdist_ext import fr_trace

    t = torch.ones(4)
    dist.all_reduce(t)
    # The list forms, recorded in the shapes torch's analyzer checks (no false size mismatch).
    dist.all_gather([torch.empty(2, 3) for _ in range(ws)], torch.ones(2, 3))
    dist.reduce_scatter(torch.empty(5), [torch.ones(5) for _ in range(ws)])
    dist.all_gather_into_tensor(torch.empty(ws * 2), torch.ones(2))
    if rank == ws - 1:  # skips the fifth collective: the others time out in it
        path = fr_trace.dump_fr_trace_to_file()
        time.sleep(5)
        return path
    dist.all_reduce(t)


def test_a_timeout_dumps_and_torchs_analyzer_names_the_missing_rank(tmp_path):
    ws = 3
    prefix = str(tmp_path / "rank_")
    res = run_ranks(_desync_body, ws, env=dict(ON, TORCH_FR_DUMP_TEMP_FILE=prefix), pg_timeout=2.0,
                    expect_failure_ranks=[0, 1])
    for r in (0, 1):
        status, payload = res[r]
        assert status == "error" and "timed out" in str(payload)
    assert sorted(os.listdir(tmp_path)) == [f"rank_{r}" for r in range(ws)]  # 0, 1 written at the timeout
    failed = pickle.load(open(f"{prefix}0", "rb"))["entries"]
    assert [e["state"] for e in failed] == ["completed"] * 4 + ["scheduled"]
    assert failed[1]["output_sizes"] == [[ws, 2, 3]] and failed[2]["input_sizes"] == [[ws, 5]]
    out = subprocess.run([sys.executable, "-m", "torchdist_ext.fr_trace", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    report = out.stdout + out.stderr  # the analyzer logs its findings
    assert out.returncode == 0, report
    assert "Not all ranks joining collective, sequence number: 5" in report, report
    assert "mismatch" not in report.lower(), report
    assert f"missing ranks: {{{ws - 1}}}" in report and "collective: tdx:all_reduce" in report
    assert "_desync_body" in report  # the stuck call's stack


def _default_file_body(rank, ws):
    from torchdist_ext import fr_trace

    dist.all_reduce(torch.ones(2))
    path = fr_trace.dump_fr_trace_to_file()
    return path, [e["profiling_name"] for e in pickle.load(open(path, "rb"))["entries"]]


def test_writes_where_torchs_writer_does(tmp_path):
    # Without TORCH_FR_DUMP_TEMP_FILE: torch's default, under the cache folder.
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ
    for rank, (path, names) in enumerate(run_ranks(_default_file_body, 2, env=dict(ON, XDG_CACHE_HOME=tmp_path))):
        assert path == str(tmp_path / "torch" / f"comm_lib_trace_rank_{rank}")
        assert names == ["tdx:all_reduce"]
