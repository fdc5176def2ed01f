"""launch/slurm.sbatch builds the srun command and the rendezvous from SLURM_* variables.

Hermetic whatever is installed: PATH holds only a folder with a fake `srun` that records the command
it was given and, per test, a fake `scontrol` (absent by default, so the template expands the
node list with torchdist_ext's parser). The template on a real cluster: tests/test_slurm.py.
"""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")


# What `scontrol show hostnames` does on a machine with the SLURM client but no cluster configuration.
_SCONTROL_WITHOUT_CONFIG = ('echo "scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2\n'
                            'echo "scontrol: fatal: Could not establish a configuration source" >&2\nexit 1\n')


def _fake(path, body):
    path.write_text(f"#!{shutil.which('bash')}\n{body}")
    path.chmod(0o755)


def _run_template(tmp_path, *args, scontrol=None, tools=None, **env_extra):
    """Runs the template as sbatch would; returns (completed process, the fake srun's argv or None).

    scontrol: None (no scontrol on PATH) or the body of a fake scontrol script.
    tools: a folder put on PATH after the fake srun's (more programs for the template to find).
    """
    fakebin = tmp_path / "bin"
    shutil.rmtree(fakebin, ignore_errors=True)
    fakebin.mkdir()
    record = tmp_path / "srun-args"
    record.unlink(missing_ok=True)
    _fake(fakebin / "srun", f'printf "%s\\n" "$@" > "{record}"\n')
    if scontrol is not None:
        _fake(fakebin / "scontrol", scontrol)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=os.pathsep.join([str(fakebin)] + ([str(tools)] if tools else [])),
               PYTHON=sys.executable, PYTHONPATH=REPO,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="cn[07-08,11]", SLURM_JOB_NUM_NODES="3",
               SLURM_CPUS_ON_NODE="4")
    env.update({k: str(v) for k, v in env_extra.items() if v is not None})
    for k, v in env_extra.items():
        if v is None:
            env.pop(k, None)
    proc = subprocess.run([shutil.which("bash"), SBATCH, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    srun_args = record.read_text().splitlines() if record.exists() else None
    return proc, srun_args


def test_sbatch_runs_srun_torchrun_with_rendezvous_from_slurm(tmp_path):
    proc, argv = _run_template(tmp_path, "examples/train_ddp.py", "--epochs", "3")
    assert proc.returncode == 0, proc.stderr
    assert argv[:5] == ["--kill-on-bad-exit=1", "--ntasks=3", "--ntasks-per-node=1", "--cpus-per-task=4",
                        sys.executable], argv
    assert argv[5:7] == ["-m", "torchdist_ext.run"], argv
    for a in ("--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=cn07:29642",
              "--rdzv-id=tdx-4242", "--max-restarts=0", "--log-dir=logs/4242"):
        assert a in argv, argv
    assert argv[-3:] == ["examples/train_ddp.py", "--epochs", "3"], argv
    assert "3 nodes x 4 workers, rendezvous cn07:29642" in proc.stderr


def test_sbatch_overrides_and_srun_alone(tmp_path):
    proc, argv = _run_template(tmp_path, "train.py", NPROC=2, MAX_RESTARTS=1, RDZV_PORT=1234)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node=2" in argv and "--max-restarts=1" in argv and "--rdzv-endpoint=cn07:1234" in argv
    proc, argv = _run_template(tmp_path, "train.py", "--lr", "0.1", LAUNCH="srun", NPROC=2)
    assert proc.returncode == 0, proc.stderr
    assert argv[:5] == ["--kill-on-bad-exit=1", "--ntasks=6", "--ntasks-per-node=2", "--cpus-per-task=1", "--label"]
    assert argv[5:] == [sys.executable, "train.py", "--lr", "0.1"], argv


def test_sbatch_keep_survivors_with_etcd(tmp_path):
    proc, argv = _run_template(tmp_path, "train.py", "--elastic", KEEP_SURVIVORS=1, RDZV_BACKEND="etcd-v3",
                               RDZV_ENDPOINT="e1:2379,e2:2379,e3:2379")
    assert proc.returncode == 0, proc.stderr
    assert argv[0] == "--no-kill" and "--kill-on-bad-exit=1" not in argv, argv
    for a in ("--rdzv-backend=etcd-v3", "--rdzv-endpoint=e1:2379,e2:2379,e3:2379", "--keep-survivors",
              "--exit-barrier-timeout=5"):
        assert a in argv, argv
    assert argv.index("--keep-survivors") < argv.index("train.py") and argv[-2:] == ["train.py", "--elastic"], argv
    assert "rendezvous e1:2379,e2:2379,e3:2379" in proc.stderr


def test_sbatch_join_job_joins_the_running_jobs_rendezvous_id_or_says_what_is_missing(tmp_path):
    proc, argv = _run_template(tmp_path, "train.py", "--elastic", KEEP_SURVIVORS=1, RDZV_BACKEND="etcd-v3",
                               RDZV_ENDPOINT="e1:2379,e2:2379,e3:2379", JOIN_JOB=17, SLURM_JOB_NUM_NODES=1,
                               SLURM_JOB_NODELIST="cn11")
    assert proc.returncode == 0, proc.stderr
    for a in ("--no-kill", "--ntasks=1", "--rdzv-id=tdx-17", "--keep-survivors", "--join", "--log-dir=logs/4242"):
        assert a in argv, argv
    assert argv.index("--join") < argv.index("train.py") and "joining job 17" in proc.stderr, (argv, proc.stderr)
    for missing in ({"KEEP_SURVIVORS": None}, {"RDZV_BACKEND": None}, {"RDZV_ENDPOINT": None}, {"LAUNCH": "srun"}):
        env = {**dict(KEEP_SURVIVORS=1, RDZV_BACKEND="etcd-v3", RDZV_ENDPOINT="e1:2379", JOIN_JOB=17), **missing}
        proc, argv = _run_template(tmp_path, "train.py", **env)
        assert proc.returncode == 2 and argv is None, (missing, proc.stderr)
        assert "JOIN_JOB=17 needs the running job's KEEP_SURVIVORS=1, RDZV_BACKEND=etcd-v3" in proc.stderr, proc.stderr
    proc, argv = _run_template(tmp_path, "train.py", KEEP_SURVIVORS=1, RDZV_BACKEND="etcd-v3", RDZV_ENDPOINT="e1:2379",
                               JOIN_JOB="17.0")
    assert proc.returncode == 2 and "JOIN_JOB must be the running job's numeric id" in proc.stderr, proc.stderr


def test_sbatch_requeued_run_waits_for_slurms_pending_rpcs_to_its_nodes(tmp_path):
    """A requeued run (SLURM_RESTART_COUNT=1) starts srun only once sdiag lists no pending RPC to one
    of its nodes; a pending RPC to another node does not hold it."""
    calls = tmp_path / "sdiag-calls"
    sdiag = (f'n=$(( $(cat "{calls}" 2>/dev/null || echo 0) + 1 )); echo $n > "{calls}"\n'
             'echo "Pending RPC statistics"; echo\n'
             'echo "Pending RPCs"\n'
             'printf "\\t 1: REQUEST_SIGNAL_TASKS    cn99\\n"\n'
             'if [ $n -le 2 ]; then printf "\\t 2: REQUEST_SIGNAL_TASKS    cn[08-09]\\n"; fi\n')
    scontrol = ('test "$1 $2" = "show hostnames" || exit 1\n'
                'case "$3" in "cn[07-08,11]") printf "cn07\\ncn08\\ncn11\\n";; "cn[08-09]") printf "cn08\\ncn09\\n";;'
                ' *) echo "$3";; esac\n')
    fakebin = tmp_path / "tools"
    fakebin.mkdir()
    for tool in ("sed", "awk", "grep", "sleep", "cat"):
        os.symlink(shutil.which(tool), fakebin / tool)
    _fake(fakebin / "sdiag", sdiag)
    proc, argv = _run_template(tmp_path, "train.py", scontrol=scontrol, SLURM_RESTART_COUNT=1,
                               tools=fakebin)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().strip() == "3", proc.stderr
    assert "restart 1 waits for slurmctld's pending RPCs to cn08" in proc.stderr, proc.stderr
    assert argv is not None and argv[-1] == "train.py", argv


def test_sbatch_errors(tmp_path):
    proc, argv = _run_template(tmp_path, "train.py", SLURM_JOB_ID=None)
    assert proc.returncode != 0 and argv is None and "not inside a SLURM job" in proc.stderr
    proc, argv = _run_template(tmp_path, "train.py", SLURM_JOB_NODELIST="cn[07-08")
    assert proc.returncode != 0 and argv is None and "without a matching ']'" in proc.stderr
    proc, argv = _run_template(tmp_path, "train.py", LAUNCH="mpirun")
    assert proc.returncode == 2 and "LAUNCH must be torchrun or srun" in proc.stderr
    proc, argv = _run_template(tmp_path)
    assert proc.returncode != 0 and "usage: sbatch launch/slurm.sbatch SCRIPT" in proc.stderr


def test_sbatch_takes_the_head_node_from_scontrol_and_falls_back_when_it_fails(tmp_path):
    # A working scontrol is asked first (here it answers a name the parser would not give).
    works = ('test "$1 $2 $3" = "show hostnames cn[07-08,11]" || exit 1\n'
             'for h in cn07-ib cn08-ib cn11-ib; do echo $h; done\n')  # line by line, as scontrol writes
    proc, argv = _run_template(tmp_path, "train.py", scontrol=works, SLURM_JOB_NODELIST="cn[07-08,11]")
    assert proc.returncode == 0, proc.stderr
    assert "--rdzv-endpoint=cn07-ib:29642" in argv, argv
    # A SLURM client without a cluster configuration (a workstation, a CI machine): the parser answers.
    proc, argv = _run_template(tmp_path, "train.py", scontrol=_SCONTROL_WITHOUT_CONFIG,
                               SLURM_JOB_NODELIST="gpu-[3-4]")
    assert proc.returncode == 0, proc.stderr
    assert "--rdzv-endpoint=gpu-3:29642" in argv and "scontrol" not in proc.stderr, (argv, proc.stderr)
