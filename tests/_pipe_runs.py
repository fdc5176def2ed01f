"""Shared by the pipeline tests: SGD steps through a schedule, and the comparison with the unsplit model."""
import torch


def train_steps(sched, parts, mine, n_stages, batch, steps, lr, after_backward=None):
    """``steps`` SGD steps of the stages ``mine`` (indices into ``parts``) through ``sched``; ``batch(step)``
    gives (x, y); ``after_backward()``, if given, runs between the schedule's step and the optimizer's. Returns {"loss": [mean micro-batch loss per step] (last stage's rank only), "grads": [{name:
    grad} per step], "params": {name: value after the steps}}, names ``<stage>.<parameter>``."""
    opt = torch.optim.SGD([p for s in mine for p in parts[s].parameters()], lr=lr)
    first, last = 0 in mine, n_stages - 1 in mine
    out = {"loss": [], "grads": []}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        losses = []
        sched.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        if last:
            out["loss"].append(torch.stack(losses).mean().item())
        if after_backward is not None:
            after_backward()
        out["grads"].append({f"{s}.{n}": p.grad.clone() for s in mine for n, p in parts[s].named_parameters()})
        opt.step()
    out["params"] = {f"{s}.{n}": p.detach().clone() for s in mine for n, p in parts[s].named_parameters()}
    return out


def assert_matches(per_rank, ref, what):
    """Every rank's piece together equals the single-process reference: losses, gradients per step, and
    the parameters after the steps (when the reference has them)."""
    losses = [r["loss"] for r in per_rank if r["loss"]]
    assert len(losses) == 1, f"{what}: exactly one rank holds the last stage"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["loss"]), msg=f"{what}: losses")
    for step, want in enumerate(ref["grads"]):
        got = {n: g for r in per_rank for n, g in r["grads"][step].items()}
        assert sorted(got) == sorted(want), f"{what}: every parameter lives on exactly one stage"
        for n, g in got.items():
            torch.testing.assert_close(g, want[n], msg=f"{what}: gradient of {n} at step {step}")
    if "params" in ref:
        for n, p in ((n, p) for r in per_rank for n, p in r["params"].items()):
            torch.testing.assert_close(p, ref["params"][n], msg=f"{what}: parameter {n} after the steps")


def reference_steps(parts, batch, steps, lr, loss_of):
    """The unsplit model (``parts`` run in order by ``loss_of(x, y)``, which returns the loss) trained in one
    process: {"loss", "grads", "params"} named like :func:`train_steps`'s."""
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    named = [(f"{s}.{n}", p) for s, part in enumerate(parts) for n, p in part.named_parameters()]
    out = {"loss": [], "grads": []}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in named})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in named}
    return out
