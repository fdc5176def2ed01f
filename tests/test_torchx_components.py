"""torchdist_ext.torchx_components: the tdx.ddp component runs with torchx's local scheduler, and
its entry point adds it next to torchx's builtins instead of hiding them."""
import os
import subprocess
import sys

import pytest

torchx = pytest.importorskip("torchx")

from torchdist_ext.torchx_components import ddp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject_entry_points(group):
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import EntryPoint

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"][group]
    return [EntryPoint(name=k, value=v, group=group) for k, v in eps.items()]


def test_entry_point_adds_tdx_ddp_and_keeps_builtins(monkeypatch):
    """What `torchx builtins` lists once the package is installed, from pyproject's entry points."""
    from importlib.metadata import EntryPoints

    from torchx.specs import finder
    from torchx.util import entrypoints

    ours = EntryPoints(_pyproject_entry_points("torchx.components"))
    monkeypatch.setattr(entrypoints.metadata, "entry_points", lambda: ours)
    monkeypatch.setattr(finder, "_components", None)
    components = finder.get_components()
    for name in ("tdx.ddp", "dist.ddp", "dist.spmd", "utils.echo", "utils.python"):
        assert name in components, sorted(components)
    assert components["tdx.ddp"].validation_errors == []
    assert not any(n.startswith("tdx.") and n != "tdx.ddp" for n in components), sorted(components)


def test_torchx_cli_lists_tdx_ddp_and_builtins_from_installed_metadata(tmp_path):
    """The same entry points as an installed package's metadata (a .dist-info on the path), read by
    the `torchx builtins` command itself."""
    info = tmp_path / "tdx_probe-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tdx-probe\nVersion: 0.0\n")
    eps = _pyproject_entry_points("torchx.components")
    (info / "entry_points.txt").write_text("[torchx.components]\n" + "".join(f"{e.name} = {e.value}\n" for e in eps))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-m", "torchx.cli.main", "builtins"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = proc.stdout.split()
    for name in ("tdx.ddp", "dist.ddp", "utils.echo"):
        assert name in listed, proc.stdout


def test_appdef_for_several_nodes():
    app = ddp("--epochs", "3", script="examples/train_ddp.py", j="2x4", backend="gloo", max_restarts=2,
              env={"GLOO_SOCKET_IFNAME": "eth0"})
    (role,) = app.roles
    assert (role.name, role.num_replicas, role.min_replicas, role.entrypoint) == ("train_ddp", 2, 2, "bash")
    line = role.args[1]
    assert line.startswith("python -m torchdist_ext.run --rdzv-backend c10d --rdzv-endpoint $${${rank0_env}:=localhost}:29500")
    for part in ("--nnodes 2", "--nproc-per-node 4", "--max-restarts 2", "examples/train_ddp.py --epochs 3"):
        assert part in line, line
    assert role.env["TDX_BACKEND"] == "gloo" and role.env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "localhost:0" in ddp(m="my.trainer", j="1x2").roles[0].args[1]


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one of --script and -m"),
    ({"script": "a.py", "m": "b"}, "exactly one of --script and -m"),
    ({"script": "a.py", "max_restarts": -1}, "max_restarts must be >= 0"),
    ({"script": "a.py", "j": "2y2"}, "Invalid format for -j"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ddp(**kwargs)


def test_runs_with_local_cwd_scheduler(tmp_path):
    ckpt = tmp_path / "digits.pt"
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    cmd = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", "torchdist_ext/torchx_components.py:ddp",
           "-j", "1x2", "--script", "examples/train_ddp.py", "--", "--epochs", "1", "--checkpoint", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Job finished: SUCCEEDED" in out, out
    assert "[rank0]:training DigitsNet on 1438 digits with 2 ranks, backend tdx" in out, out
    assert "[rank0]:final step 23" in out and ckpt.exists(), out
