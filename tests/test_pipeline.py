"""Pipeline parallelism across processes: GPipe, 1F1B and interleaved 1F1B on 2 and 4 ranks give the
losses, gradients and parameters of the unsplit model trained in one process (within fp32
rounding); pp=2 x dp=2 composes with DistributedDataParallel; bad input fails with a clear error."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_ranks

BATCH, WIDTH, CLASSES, STEPS, LR = 24, 16, 5, 2, 0.1


def _model(n_parts):
    """2 layers per part; every rank builds the same weights."""
    torch.manual_seed(0)
    layers = []
    for i in range(n_parts):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers[-1] = nn.Linear(WIDTH, CLASSES)
    return nn.Sequential(*layers)


def _batch(step, batch=BATCH):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, WIDTH, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _reference(n_parts, batch=BATCH):
    """The unsplit model in one process: per step the full-batch loss, gradients, then SGD."""
    model = _model(n_parts)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"loss": [], "grads": [], "params": None}
    for step in range(STEPS):
        x, y = _batch(step, batch)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out["eval"] = model(_batch(STEPS, batch)[0])
    return out


def _train(rank, ws, schedule, m, stages_per_rank=1, static_shapes=False, batch_weight_grads=True):
    from torchdist_ext.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                        split_sequential)

    n_stages = ws * stages_per_rank
    parts = split_sequential(_model(n_stages), n_stages)
    mine = [rank + c * ws for c in range(stages_per_rank)]
    stages = [PipelineStage(parts[i], i, n_stages, "cpu",
                            input_args=torch.empty(BATCH // m, WIDTH) if static_shapes and i > 0 else None,
                            batch_weight_grads=batch_weight_grads)
              for i in mine]
    params = [p for i in mine for p in parts[i].parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    loss_fn = nn.functional.cross_entropy
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], m, loss_fn=loss_fn)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    _check_receive_placement(sched.pipeline_order[rank], late=dist.get_backend() == "tdx")
    out = {"loss": [], "grads": [], "params": {}, "eval": None}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        losses = []
        sched.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        if last:
            assert len(losses) == m
            out["loss"].append(torch.stack(losses).mean().item())
        out["grads"].append({f"{n}": p.grad.clone() for i in mine for n, p in parts[i].named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for i in mine for n, p in parts[i].named_parameters()}
    out["eval"] = sched.eval(*([_batch(STEPS)[0]] if first else []))
    kept = sum(s.peak_pending_weight_grad_bytes for s in stages)
    assert (kept > 0) == (batch_weight_grads and m > 1), (kept, batch_weight_grads, m)
    return out


def _check_receive_placement(actions, late):
    """tdx (CPU) posts every receive right before the compute action that consumes it; gloo ahead of it."""
    from torchdist_ext.pipeline._actions import RECV_B, RECV_F

    recv_at = [i for i, a in enumerate(actions) if a.type in (RECV_F, RECV_B)]
    adjacent = [(actions[i + 1].stage, actions[i + 1].microbatch) == (actions[i].stage, actions[i].microbatch)
                for i in recv_at]
    if late:
        assert all(adjacent), actions
    elif len(recv_at) > 1:
        assert not all(adjacent), actions


def _run_configs(rank, ws, configs):
    return {c: _train(rank, ws, *c) for c in configs}


def _check(results, configs, n_parts_of):
    for c in configs:
        ref = _reference(n_parts_of(c))
        per_rank = [r[c] for r in results]
        losses = [r["loss"] for r in per_rank if r["loss"]]
        assert len(losses) == 1, f"{c}: exactly one rank holds the last stage"
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["loss"]), msg=f"{c}: losses")
        for step in range(STEPS):
            got = {n: g for r in per_rank for n, g in r["grads"][step].items()}
            assert sorted(got) == sorted(ref["grads"][step]), f"{c}: every parameter lives on exactly one stage"
            for n, g in got.items():
                torch.testing.assert_close(g, ref["grads"][step][n], msg=f"{c}: gradient of {n} at step {step}")
        got = {n: p for r in per_rank for n, p in r["params"].items()}
        for n, p in got.items():
            torch.testing.assert_close(p, ref["params"][n], msg=f"{c}: parameter {n} after {STEPS} steps")
        evals = [r["eval"] for r in per_rank if r["eval"] is not None]
        assert len(evals) == 1
        torch.testing.assert_close(evals[0], ref["eval"], msg=f"{c}: eval() outputs")


# (schedule, micro-batches[, stages per rank, shapes given, batch_weight_grads])
CONFIGS_2 = [("gpipe", 4), ("1f1b", 4), ("1f1b", 3, 1, True), ("gpipe", 1), ("interleaved", 4, 2),
             ("1f1b", 4, 1, False, False)]
CONFIGS_4 = [("gpipe", 4), ("1f1b", 8), ("interleaved", 4, 2)]


@pytest.mark.parametrize("backend,configs", [("tdx", CONFIGS_2), ("gloo", CONFIGS_2[1:2] + CONFIGS_2[4:5])])
def test_two_stages_match_unsplit_model(backend, configs):
    """(schedule, micro-batches[, stages per rank, shapes given]) on 2 ranks; the same code on gloo."""
    results = run_ranks(_run_configs, 2, configs, backend=backend)
    _check(results, configs, lambda c: 2 * (c[2] if len(c) > 2 else 1))


def test_one_rank_runs_every_stage_locally():
    """World size 1: one stage, and interleaved stages handing tensors over on the same rank."""
    configs = [("1f1b", 4), ("interleaved", 2, 3)]
    results = run_ranks(_run_configs, 1, configs)
    _check(results, configs, lambda c: c[2] if len(c) > 2 else 1)


def _default_batching(rank, ws):
    """Which layers batch their weight gradients by default, and that they do in a step."""
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 256))
    got = {flag: PipelineStage(wide, 0, 1, "cpu", batch_weight_grads=flag)._wgrad for flag in (None, True, False)}
    layers = {flag: b.layers if b is not None else 0 for flag, b in got.items()}
    narrow = PipelineStage(nn.Linear(WIDTH, WIDTH), 0, 1, "cpu")._wgrad
    with pytest.raises(ValueError, match="batch_weight_grads must be None"):
        PipelineStage(wide, 0, 1, "cpu", batch_weight_grads="yes")
    stage = PipelineStage(wide, 0, 1, "cpu")
    ref = {n: p.detach().clone() for n, p in wide.named_parameters()}
    x, y = torch.randn(8, 512), torch.randn(8, 256)
    Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss).step(x, target=y)
    got_grads = {n: p.grad.clone() for n, p in wide.named_parameters()}
    ref_model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 256))
    ref_model.load_state_dict(ref)
    nn.functional.mse_loss(ref_model(x), y).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    return layers, narrow is None, stage.peak_pending_weight_grad_bytes, got_grads, ref_grads


def test_default_batches_the_wide_layers_only():
    """batch_weight_grads=None (the default) batches the layers the decision room picks (at least
    512 x 512 weights: Linear(512, 512), not Linear(512, 256) nor Linear(256, 256)); True every layer,
    False none; the batched step's gradients equal the unsplit model's."""
    layers, narrow_off, kept, grads, ref = run_ranks(_default_batching, 1)[0]
    assert layers == {None: 1, True: 3, False: 0}
    assert narrow_off
    assert kept > 0
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], msg=f"gradient of {n}")


def test_four_stages_match_unsplit_model():
    results = run_ranks(_run_configs, 4, CONFIGS_4)
    _check(results, CONFIGS_4, lambda c: 4 * (c[2] if len(c) > 2 else 1))


# --- pp x dp ------------------------------------------------------------------------------------

def _pp_dp(rank, ws, ddp_impl):
    """Ranks (0, 1) and (2, 3) are two pipelines; ranks (0, 2) and (1, 3) replicate one stage each."""
    import torchdist_ext
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, split_sequential

    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage_index = divmod(rank, 2)
    part = split_sequential(_model(2), 2)[stage_index]
    if ddp_impl == "ours":
        module = torchdist_ext.DistributedDataParallel(part, process_group=dp_groups[stage_index])
    else:
        module = torch.nn.parallel.DistributedDataParallel(part, process_group=dp_groups[stage_index])
    stage = PipelineStage(module, stage_index, 2, "cpu", group=pp_groups[replica])
    sched = Schedule1F1B(stage, 4, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    out = {"grads": [], "loss": []}
    for step in range(STEPS):
        x, y = _batch(step, 2 * BATCH)
        half = slice(replica * BATCH, (replica + 1) * BATCH)  # each replica takes half of the global batch
        opt.zero_grad()
        losses = []
        if stage.is_first:
            sched.step(x[half])
        else:
            sched.step(target=y[half], losses=losses)
            out["loss"].append(torch.stack(losses).mean().item())
        out["grads"].append({n: p.grad.clone() for n, p in part.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in part.named_parameters()}
    return out


@pytest.mark.parametrize("ddp_impl", ["ours", "torch"])
def test_pp2_dp2_matches_unsplit_model(ddp_impl):
    results = run_ranks(_pp_dp, 4, ddp_impl)
    ref = _reference(2, batch=2 * BATCH)
    for rank, r in enumerate(results):
        for step in range(STEPS):
            for n, g in r["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][n], msg=f"rank {rank}: gradient of {n}, step {step}")
        for n, p in r["params"].items():
            torch.testing.assert_close(p, ref["params"][n], msg=f"rank {rank}: parameter {n}")
    # the two replicas' mean loss is the global batch's loss
    glob = [(a + b) / 2 for a, b in zip(results[1]["loss"], results[3]["loss"])]
    torch.testing.assert_close(torch.tensor(glob), torch.tensor(ref["loss"]))


class _ScaledHead(nn.Module):
    """A last stage with a keyword input of its own: per-sample scales of the logits."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, CLASSES)

    def forward(self, h, scale=None):
        return self.lin(h) * scale[:, None]


def _kwarg_parts():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), _ScaledHead()]


def _scale(step):
    return torch.rand(BATCH, generator=torch.Generator().manual_seed(7 + step)) + 0.5


def _train_with_stage_kwargs(rank, ws, schedules):
    return {s: _train_one_with_stage_kwargs(rank, s) for s in schedules}


def _train_one_with_stage_kwargs(rank, schedule):
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

    part = _kwarg_parts()[rank]
    sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](PipelineStage(part, rank, 2, "cpu"), 4,
                                                                      loss_fn=nn.functional.cross_entropy)
    out = {"loss": [], "grads": []}
    for step in range(STEPS):
        x, y = _batch(step)
        for p in part.parameters():
            p.grad = None
        losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses, scale=_scale(step))  # a keyword input of the last stage only
            out["loss"].append(torch.stack(losses).mean().item())
        out["grads"].append({n: p.grad.clone() for n, p in part.named_parameters()})
    return out


def test_keyword_inputs_of_a_later_stage():
    """step(scale=...) on the last stage's rank: split into micro-batches and passed to its forward next to
    the received activations; losses and gradients equal the unsplit model's."""
    first, head = _kwarg_parts()
    ref = {"loss": [], "grads": []}
    for step in range(STEPS):
        x, y = _batch(step)
        first.zero_grad()
        head.zero_grad()
        loss = nn.functional.cross_entropy(head(first(x), scale=_scale(step)), y)
        loss.backward()
        ref["loss"].append(loss.item())
        ref["grads"].append([{n: p.grad.clone() for n, p in m.named_parameters()} for m in (first, head)])
    per_rank = run_ranks(_train_with_stage_kwargs, 2, ("gpipe", "1f1b"))
    for schedule in ("gpipe", "1f1b"):
        results = [r[schedule] for r in per_rank]
        torch.testing.assert_close(torch.tensor(results[1]["loss"]), torch.tensor(ref["loss"]))
        for rank in range(2):
            for step in range(STEPS):
                for n, g in results[rank]["grads"][step].items():
                    torch.testing.assert_close(g, ref["grads"][step][rank][n], msg=f"{schedule}: rank {rank}: {n}")


# --- clear errors ---------------------------------------------------------------------------------

def _bad_input(rank, ws):
    from torchdist_ext.pipeline import PipelineStage, ScheduleGPipe

    errors = {}
    parts = [nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, CLASSES)]
    # stages disagree on num_stages: every rank raises at the first step, naming every rank's view
    stage = PipelineStage(parts[rank], rank, 2 + rank, "cpu")
    sched = ScheduleGPipe(stage, 2, loss_fn=nn.functional.cross_entropy)
    x, y = _batch(0)
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except ValueError as e:
        errors["num_stages"] = str(e)
    # stage s must run on group rank s: here the two ranks swapped their stages
    sched = ScheduleGPipe(PipelineStage(parts[rank], 1 - rank, 2, "cpu"), 2, loss_fn=nn.functional.cross_entropy)
    try:
        sched.step(target=y) if rank == 0 else sched.step(x)
    except ValueError as e:
        errors["layout"] = str(e)
    # micro-batches that do not divide the batch: raised before any message is sent
    sched = ScheduleGPipe(PipelineStage(parts[rank], rank, 2, "cpu"), 5, loss_fn=nn.functional.cross_entropy)
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except ValueError as e:
        errors["divide"] = str(e)
    # inputs or target on the wrong rank; step() under no_grad
    try:
        sched.step(x, target=y)
    except ValueError as e:
        errors["wrong_rank"] = str(e)
    try:
        with torch.no_grad():
            sched.step(x) if rank == 0 else sched.step(target=y)
    except RuntimeError as e:
        errors["no_grad"] = str(e)
    # torch's signatures are accepted; what is not implemented says so
    for make, exc, key in [
        (lambda: ScheduleGPipe(PipelineStage(parts[rank], rank, 2, "cpu"), 2, None, args_chunk_spec=(None,)),
         NotImplementedError, "chunk_spec"),
        (lambda: PipelineStage(parts[rank], rank, 2, "cpu", dw_builder=lambda: None), NotImplementedError, "dw"),
        (lambda: ScheduleGPipe(parts[rank], 2), TypeError, "not_a_stage"),
        (lambda: ScheduleGPipe(PipelineStage(parts[rank], rank, 2, "cpu"), 0), ValueError, "zero_mb"),
        (lambda: PipelineStage(parts[rank], 2, 2, "cpu"), ValueError, "stage_index"),
    ]:
        try:
            make()
        except exc as e:
            errors[key] = str(e)
    return errors


def test_errors_num_stages_and_microbatches():
    results = run_ranks(_bad_input, 2, timeout=120)
    for rank, errors in enumerate(results):
        assert "disagree on num_stages" in errors["num_stages"], errors
        assert "rank 0: ScheduleGPipe, stages [0], num_stages [2]" in errors["num_stages"]
        assert "rank 1: ScheduleGPipe, stages [1], num_stages [3]" in errors["num_stages"]
        what = "positional input 0" if rank == 0 else "target"
        assert f"step(): {what} has batch size 24 along dim 0, which n_microbatches=5 does not divide" in errors["divide"], errors
        assert "group rank 0 holds stages [1] but must hold [0]" in errors["layout"], errors
        wrong = ("target is given on rank 0, which does not hold the last stage" if rank == 0 else
                 "rank 1 holds stages [1], not the first stage, so it takes no positional inputs")
        assert wrong in errors["wrong_rank"], errors
        assert "use eval() for forward-only passes" in errors["no_grad"]
        assert "output_merge_spec are not implemented" in errors["chunk_spec"]
        assert "dw_builder" in errors["dw"] and "got Linear" in errors["not_a_stage"]
        assert "n_microbatches must be a positive int, got 0" in errors["zero_mb"]
        assert "stage_index must be in 0..1" in errors["stage_index"]


class _GrowsAfterFirstCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return h if self.calls == 1 else torch.cat([h, h])


def _shape_change(rank, ws):
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B

    module = _GrowsAfterFirstCall() if rank == 0 else nn.Linear(WIDTH, CLASSES)
    sched = Schedule1F1B(PipelineStage(module, rank, 2, "cpu"), 4, loss_fn=nn.functional.cross_entropy)
    x, y = _batch(0)
    sched.step(x) if rank == 0 else sched.step(target=y)


def test_error_when_output_shape_changes_between_microbatches():
    out = run_ranks(_shape_change, 2, expect_failure_ranks=[0, 1], timeout=120, pg_timeout=30)
    status, msg = out[0]
    assert status == "error" and "ValueError" in msg and "output shape changed between micro-batches" in msg, msg
    assert "micro-batch 1 produced [(12, 16) float32]" in msg and "produced [(6, 16) float32]" in msg, msg
    # the peer does not hang: it fails (rank 0 exited) instead of waiting forever
    assert out[1][0] in ("error", "died"), out[1]


# --- the poster thread (gloo) -------------------------------------------------------------------------

def _poster_run(rank, ws):
    import gc
    import threading

    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B
    from torchdist_ext.pipeline._comm import posts_from_thread
    from torchdist_ext.pipeline._poster import Poster

    out = {"from_thread": posts_from_thread(dist.group.WORLD, "cpu")}
    peer = 1 - rank
    poster = Poster(dist.group.WORLD)
    # in order on one flow: 5 messages of one tag, each received into its own buffer
    got = [torch.empty(3) for _ in range(5)]
    handles = [poster.irecv(b, peer, 7) for b in got]
    sends = [poster.isend(torch.full((3,), float(10 * rank + i)), peer, 7) for i in range(5)]
    for h in handles + sends:
        h.wait()
    out["got"] = [b[0].item() for b in got]
    try:  # an error from the backend while posting comes out of wait()
        poster.isend(torch.ones(4)[::2], peer, 0).wait()  # gloo refuses a non-contiguous tensor
        out["error"] = None
    except Exception as err:  # noqa: BLE001 - the backend's own exception type
        out["error"] = f"{type(err).__name__}: {err}"
    # after a failed step: what was given but not posted yet is dropped (its wait() raises); what the
    # thread was posting is posted
    entered, gate, post = threading.Event(), threading.Event(), poster._post
    poster._post = lambda *item: (entered.set(), gate.wait(), post(*item))
    first, dropped = torch.empty(1), torch.empty(1)
    posted = poster.irecv(first, peer, 9)
    entered.wait()
    lost = poster.irecv(dropped, peer, 9)
    threading.Timer(0.5, gate.set).start()
    poster.abandon()
    poster._post = post
    out["abandoned"] = None
    try:
        lost.wait()
    except RuntimeError as err:
        out["abandoned"] = str(err)
    poster.isend(torch.full((1,), 5.0 + rank), peer, 9).wait()
    posted.wait()
    out["posted"] = first.item()
    poster.stop(timeout=10)
    out["stopped"] = not poster._thread.is_alive()
    # after stop: posted by the caller, not lost
    late = torch.empty(1)
    recv_late = poster.irecv(late, peer, 11)
    poster.isend(torch.full((1,), float(rank)), peer, 11).wait()
    recv_late.wait()
    out["late"] = late.item()
    # a schedule's poster ends with the schedule
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(4, 4), rank, ws, "cpu")
    sched = Schedule1F1B(stage, 2, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    if rank == 0:
        sched.step(torch.randn(4, 4))
    else:
        sched.step(target=torch.randn(4, 4))
    thread = sched._poster._thread
    del sched
    gc.collect()
    thread.join(10)
    out["schedule_poster_ended"] = not thread.is_alive()
    out["threads"] = [t.name for t in threading.enumerate() if t.name == "tdx-pipeline-poster"]
    return out


def test_gloo_posts_from_a_thread_in_order_and_raises_its_errors():
    """On gloo the schedules post sends and receives from a background thread: one flow's messages
    arrive in order, a backend error while posting is raised by the operation's wait(), after a failed
    step what was not posted yet is dropped with an error, after stop() the caller posts, and the thread
    ends with its schedule. On tdx inside a host they stay on the schedule's thread."""
    runs = run_ranks(_poster_run, 2, backend="gloo")
    for rank, run in enumerate(runs):
        peer = 1 - rank
        assert run["from_thread"] is True
        assert run["got"] == [float(10 * peer + i) for i in range(5)], run["got"]
        assert run["error"] is not None and "contiguous" in run["error"], run["error"]
        assert run["abandoned"] == "not posted: the pipeline step failed before" and run["posted"] == 5.0 + peer, run
        assert run["late"] == float(peer), run["late"]
        assert run["stopped"] and run["schedule_poster_ended"] and run["threads"] == [], run
    assert run_ranks(_from_thread, 2) == [False, False]


def _from_thread(rank, ws):
    from torchdist_ext.pipeline._comm import posts_from_thread

    return posts_from_thread(dist.group.WORLD, "cpu")
