"""torchdist_ext.launch: the launch environment of torchrun and srun, read from fake environments,
plus one multi-process run that initializes through the SLURM path."""
import os
import socket

import pytest
import torch

from torchdist_ext.launch import expand_slurm_nodelist, read_launch_env, slurm_port

from _dist import run_ranks

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456"}


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[008-010]", ["node008", "node009", "node010"]),
    ("a[1-2],b,c[05]", ["a1", "a2", "b", "c05"]),
    ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
    ("gpu-[3]-ib", ["gpu-3-ib"]),
    (" n[1 - 2] ", ["n1", "n2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_slurm_nodelist(text, hosts):
    assert expand_slurm_nodelist(text) == hosts


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("node[01-04", "without a matching ']'"),
    ("node01-04]", "without a matching '['"),
    ("node[]", "empty brackets"),
    ("node[04-01]", "backwards"),
    ("node[a-b]", "'a-b' is not a number"),
    ("a,,b", "empty host name"),
    ("n[1-[2]]", "nested"),
])
def test_expand_slurm_nodelist_rejects_malformed(text, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        expand_slurm_nodelist(text)


def test_torchrun_variables():
    env = read_launch_env(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("node0", 29500, "torchrun")


def test_torchrun_takes_precedence_over_slurm():  # `srun torchrun`: the workers see both
    assert read_launch_env({**SLURM, **TORCHRUN}).source == "torchrun"


def test_torchrun_without_local_variables_means_one_host():
    env = read_launch_env({k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL")})
    assert (env.local_rank, env.local_world_size) == (3, 4)


@pytest.mark.parametrize("drop", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_missing_variable_is_named(drop):
    with pytest.raises(ValueError, match=f"{drop} missing"):
        read_launch_env({k: v for k, v in TORCHRUN.items() if k != drop})


@pytest.mark.parametrize("change, words", [
    ({"RANK": "4"}, "rank 4 is not below world size 4"),
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"LOCAL_RANK": "2"}, "local rank 2 is not below local world size 2"),
    ({"LOCAL_WORLD_SIZE": "8"}, "local world size 8 exceeds world size 4"),
    ({"MASTER_PORT": "70000"}, "not a TCP port"),
    ({"LOCAL_WORLD_SIZE": ""}, "LOCAL_RANK is set but LOCAL_WORLD_SIZE is missing"),
])
def test_torchrun_bad_values(change, words):
    with pytest.raises(ValueError, match=words):
        read_launch_env({**TORCHRUN, **change})


def test_nothing_set_says_how_to_launch():
    with pytest.raises(ValueError, match="torchrun.*srun"):
        read_launch_env({"HOME": "/root"})


def test_slurm_variables():
    env = read_launch_env(SLURM)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("gpu07", slurm_port("123456"), "slurm")
    assert env.master_port == 20000 + 123456 % 10000


def test_slurm_uneven_tasks_per_node_and_overrides():
    env = read_launch_env({**SLURM, "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2", "SLURM_PROCID": "6",
                           "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (env.local_world_size, env.master_addr, env.master_port) == (1, "head", 4000)
    env = read_launch_env({**{k: v for k, v in SLURM.items() if k not in ("SLURM_TASKS_PER_NODE", "SLURM_NODEID")},
                           "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "step[3-4]"})
    assert (env.local_world_size, env.master_addr) == (2, "step3")


@pytest.mark.parametrize("drop, words", [
    ("SLURM_NTASKS", "SLURM_NTASKS missing"),
    ("SLURM_LOCALID", "SLURM_LOCALID missing"),
    ("SLURM_NODELIST", r"SLURM_NODELIST \(or MASTER_ADDR\) missing"),
    ("SLURM_JOB_ID", r"SLURM_JOB_ID \(or MASTER_PORT\) missing"),
    ("SLURM_TASKS_PER_NODE", "how many tasks run on this node"),
])
def test_slurm_missing_variable_is_named(drop, words):
    with pytest.raises(ValueError, match=words):
        read_launch_env({k: v for k, v in SLURM.items() if k != drop})


def test_slurm_bad_values_are_named():
    with pytest.raises(ValueError, match="SLURM_NODELIST: SLURM nodelist 'gpu\\[07-10': .*matching"):
        read_launch_env({**SLURM, "SLURM_NODELIST": "gpu[07-10"})
    with pytest.raises(ValueError, match="SLURM_NODEID=4 is beyond the 4 nodes"):
        read_launch_env({**SLURM, "SLURM_NODEID": "4"})
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='2x4' is malformed"):
        read_launch_env({**SLURM, "SLURM_TASKS_PER_NODE": "2x4"})
    with pytest.raises(ValueError, match="rank 8 is not below world size 8"):
        read_launch_env({**SLURM, "SLURM_PROCID": "8"})


def test_init_distributed_refuses_rendezvous_arguments():
    from torchdist_ext import init_distributed

    with pytest.raises(TypeError, match="init_method= is taken from the launch environment"):
        init_distributed("tdx", init_method="file:///tmp/x", environ=TORCHRUN)


def _slurm_rank_env(rank):
    # What srun gives each of 4 tasks on one node (no torchrun variables).
    return {"SLURM_PROCID": rank, "SLURM_NTASKS": 4, "SLURM_LOCALID": rank, "SLURM_NODEID": 0,
            "SLURM_TASKS_PER_NODE": "4", "SLURM_NODELIST": socket.gethostname(), "SLURM_JOB_ID": "77"}


def _init_from_slurm_and_reduce(rank, world_size):
    import torch.distributed as dist

    from torchdist_ext import init_distributed

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(k, None)
    env = init_distributed()  # backend from TDX_BACKEND (set by the test), rendezvous from SLURM_*
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    info = (env.rank, env.world_size, env.local_world_size, env.master_addr, dist.get_backend(),
            os.environ["LOCAL_WORLD_SIZE"])
    dist.destroy_process_group()
    return info, t


def test_init_distributed_under_srun_alone():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = run_ranks(_init_from_slurm_and_reduce, 4, backend=None, timeout=120, rank_env=_slurm_rank_env,
                    env={"MASTER_PORT": port, "TDX_BACKEND": "tdx"})
    for rank, (info, t) in enumerate(out):
        assert info == (rank, 4, 4, socket.gethostname(), "tdx", "4")
        assert torch.equal(t, torch.full((3,), 10.0))


def test_warns_when_torchrun_restarts_share_the_store(monkeypatch):
    from torchdist_ext.launch import _warn_if_restarts_share_the_store

    env = read_launch_env({**TORCHRUN, "RANK": "0"})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _warn_if_restarts_share_the_store(env)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what torchdist_ext.run arranges
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_restarts_share_the_store(env)


def test_stale_rendezvous_after_torchrun_restart_is_explained(monkeypatch):
    from torchdist_ext._backend import _explain_stale_rendezvous

    err = RuntimeError("tdx: cannot open peer shared-memory segment /tdx-1-x: No such file or directory")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _explain_stale_rendezvous(err) is None  # first attempt: the original error stands
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(RuntimeError, match="restarted by torchrun.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _explain_stale_rendezvous(err)
    assert _explain_stale_rendezvous(RuntimeError("tdx: something else")) is None
