"""Checkpoint state of the servers: each server's part, and the merge into one dict that names whole
parameters, so a job resumes with another worker count, server count or ``split_bytes``.

The merged dict: ``params`` and ``optimizer_state`` by parameter name (full tensors; a state tensor
shaped like its parameter is split and joined by rows, any other value is the same on every piece),
the optimizer's ``param_groups`` hyperparameters (lr included) and class name, the update count.
"""
import torch

__all__ = []

FORMAT = "torchdist_ext.ps/1"


def server_state(server) -> dict:
    """One server's part: its pieces with their optimizer state, hyperparameters, update count."""
    opt = server.optimizer.state_dict()
    pieces = []
    for i, (piece, p) in enumerate(zip(server.pieces, server.params)):
        pieces.append({"name": server.plan.names[piece.index], "rows": piece.rows, "param": p.detach(),
                       "state": opt["state"].get(i, {})})
    stats = getattr(server, "stats", None)
    return {"format": FORMAT, "server": server.shard, "pieces": pieces,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
            "optimizer": type(server.optimizer).__name__,
            "updates": stats.updates if stats is not None else server._updates0}


def merge(parts) -> dict:
    """The server parts of one checkpoint as one dict keyed by parameter name."""
    got = {}
    for part in parts:
        for pc in part["pieces"]:
            got.setdefault(pc["name"], []).append(pc)
    params, state = {}, {}
    for name, pcs in got.items():
        if pcs[0]["rows"] is None:
            params[name], state[name] = pcs[0]["param"], dict(pcs[0]["state"])
            continue
        pcs.sort(key=lambda pc: pc["rows"][0])
        params[name] = torch.cat([pc["param"] for pc in pcs])
        state[name] = {}
        for key, first in pcs[0]["state"].items():
            by_rows = isinstance(first, torch.Tensor) and first.shape == pcs[0]["param"].shape
            state[name][key] = torch.cat([pc["state"][key] for pc in pcs]) if by_rows else first
    return {"format": FORMAT, "params": params, "optimizer_state": {k: v for k, v in state.items() if v},
            "param_groups": parts[0]["param_groups"], "optimizer": parts[0]["optimizer"],
            "updates": max(part["updates"] for part in parts)}


def load_server_state(server, state) -> int:
    """Copies ``state`` (from ``merge``) into ``server``'s pieces and optimizer; returns the update count."""
    who = f"ps.ParameterServer rank {server.rank}.load_state_dict"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{who}: expected the dict that ps.load returns (format {FORMAT!r}), got "
                         f"{type(state).__name__} with format {getattr(state, 'get', lambda _: None)('format')!r}")
    plan, params = server.plan, state["params"]
    missing = [n for n in plan.names if n not in params]
    unexpected = [n for n in params if n not in plan.names]
    wrong = [f"{n} {list(params[n].shape)} (the model has {list(s)})" for n, s in zip(plan.names, plan.shapes)
             if n in params and tuple(params[n].shape) != s]
    if missing or unexpected or wrong:
        raise ValueError(f"{who}: the checkpoint does not fit the model: missing {missing}, unexpected {unexpected}, "
                         f"other shapes {wrong}")
    kind = type(server.optimizer).__name__
    if state["optimizer"] != kind:
        raise ValueError(f"{who}: the checkpoint holds {state['optimizer']} state but this server runs {kind}; "
                         "build the server with the optimizer class it was saved with")
    if len(state["param_groups"]) != 1:
        raise ValueError(f"{who}: the checkpoint has {len(state['param_groups'])} parameter groups; a server has one")
    opt_state = {}
    for i, (piece, p) in enumerate(zip(server.pieces, server.params)):
        name = plan.names[piece.index]
        full = params[name]
        with torch.no_grad():
            p.copy_(full if piece.whole else full[piece.rows[0]:piece.rows[1]])
        if name in state["optimizer_state"]:
            opt_state[i] = {k: _rows(v, piece, full.shape) for k, v in state["optimizer_state"][name].items()}
    group = dict(state["param_groups"][0], params=list(range(len(server.params))))
    server.optimizer.load_state_dict({"state": opt_state, "param_groups": [group]})
    return int(state["updates"])


def _rows(value, piece, shape):
    """A piece's share of one optimizer state value: its rows of a tensor shaped like the parameter, a
    copy of any other tensor (a scalar ``step`` is stepped in place, and a server process may hold
    two pieces of one parameter: its own and the replica's)."""
    if not isinstance(value, torch.Tensor):
        return value
    if piece.whole or value.shape != shape:
        return value.clone()
    return value[piece.rows[0]:piece.rows[1]].clone()
