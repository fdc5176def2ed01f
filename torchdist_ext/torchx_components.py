"""torchx components for torchdist_ext (needs the optional extra: ``pip install torchdist_ext[torchx]``).

Registered under the ``torchx.components`` entry point as group ``tdx`` (next to torchx's own
builtins, which stay visible), so after installing the package::

    torchx run -s local_cwd tdx.ddp -j 1x2 --script examples/train_ddp.py -- --epochs 2
    torchx run -s slurm -cfg partition=cpu,time=00:30:00 tdx.ddp -j 2x8 --script examples/train_ddp.py

Without installing, name the file instead::

    torchx run -s local_cwd torchdist_ext/torchx_components.py:ddp -j 1x2 --script examples/train_ddp.py

This module defines only components: torchx lists every function found here.
"""
import shlex
from typing import Dict, List, Optional

import torchx
import torchx.specs as specs
from torchx.components import dist as _torchx_dist
from torchx.components import structured_arg as _structured_arg


def ddp(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    image: str = torchx.IMAGE,
    name: str = "/",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    j: str = "1x2",
    env: Optional[Dict[str, str]] = None,
    backend: str = "tdx",
    max_restarts: int = 0,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    rdzv_backend: str = "c10d",
    mounts: Optional[List[str]] = None,
    log_dir: str = "",
) -> specs.AppDef:
    """
    Data-parallel training on the "tdx" backend: one role, ``nnodes`` replicas, each running
    ``python -m torchdist_ext.run`` (torchrun with per-rank log prefixes and a report naming a
    failed rank and its log) with ``nproc_per_node`` workers. The script initializes with
    ``torchdist_ext.init_distributed()``, which picks the backend from ``TDX_BACKEND`` (set here).

    Args:
        script_args: arguments to the script or module
        script: the training script to run (exactly one of script and m)
        m: the python module to run instead of a script
        image: image (e.g. docker) or, for local_cwd/slurm, the working directory
        name: job name: ``{experimentname}/{runname}``, ``{experimentname}/``, ``/{runname}`` or ``{runname}``
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        cpu: number of cpus per replica
        gpu: number of gpus per replica
        memMB: cpu memory in MB per replica
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}
        env: environment variables for the workers (e.g. GLOO_SOCKET_IFNAME=eth0,TDX_NODE_ID=n0)
        backend: process-group backend passed to the script as TDX_BACKEND (tdx, gloo, cpu:tdx,cuda:nccl)
        max_restarts: torchrun restarts of the worker group after a failure (elastic; needs checkpoints)
        max_retries: scheduler retries of the whole job
        rdzv_port: port of the c10d rendezvous on the first replica's host (multi-node only)
        rdzv_backend: torchrun rendezvous backend
        mounts: mounts for the workers (type=<bind/volume>,src=/host,dst=/job[,readonly])
        log_dir: directory for per-rank logs (default: a new temporary directory on each node)
    """
    if (script is None) == (m is None):
        raise ValueError(f"tdx.ddp: give exactly one of --script and -m (got script={script!r}, m={m!r})")
    if max_restarts < 0:
        raise ValueError(f"tdx.ddp: --max_restarts must be >= 0, got {max_restarts}")
    min_nnodes, max_nnodes, nproc_per_node, nnodes_rep = _torchx_dist.parse_nnodes(j)
    if max_nnodes == 1:
        endpoint = "localhost:0"  # one agent: torchrun picks a free port
    else:
        # The scheduler fills in the name of the variable holding the first replica's host ("$$" escapes
        # torchx's own macro substitution); bash expands it on each replica.
        endpoint = f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"
    run_name = _structured_arg.StructuredNameArgument.parse_from(name=name, m=m, script=script)
    env = dict(env or {})
    env.setdefault("TDX_BACKEND", backend)
    env.setdefault("LOGLEVEL", "WARNING")
    env["TORCHX_TRACKING_EXPERIMENT_NAME"] = run_name.experiment_name
    cmd = ["python", "-m", "torchdist_ext.run", "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", "{endpoint}",
           "--rdzv-id", specs.macros.app_id, "--nnodes", nnodes_rep, "--nproc-per-node", str(nproc_per_node),
           "--max-restarts", str(max_restarts), "--role", ""]
    if log_dir:
        cmd += ["--log-dir", log_dir]
    if rdzv_backend == "static":
        cmd += ["--node-rank", specs.macros.replica_id]
    cmd += [script] if script is not None else ["-m", m]
    cmd += list(script_args)
    # Quote everything but the endpoint, which the shell must expand on each replica.
    line = " ".join(endpoint if a == "{endpoint}" else shlex.quote(a) for a in cmd)
    role = script.rsplit("/", 1)[-1].rsplit(".", 1)[0] if script is not None else m.rpartition(".")[2]
    return specs.AppDef(
        name=run_name.run_name,
        roles=[
            specs.Role(
                name=role,
                image=image,
                entrypoint="bash",
                args=["-c", line],
                min_replicas=min_nnodes,
                num_replicas=max_nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=env,
                port_map={"c10d": rdzv_port},
                max_retries=max_retries,
                mounts=specs.parse_mounts(mounts) if mounts else [],
            )
        ],
    )
