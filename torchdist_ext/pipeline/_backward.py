"""The split backward of zero-bubble schedules: the input gradient now (``I``), the weight gradients later (``W``).

Works on any module's autograd graph, not only on ``nn.Linear``:

``backward_input`` walks the graph from the stage's outputs once and marks every node that leads to
a stage input ("input side"); every other node that leads to a parameter is "weight side". The
autograd engine, asked for the gradients of the inputs only (``torch.autograd.grad(inputs=...)``,
keeping the graph), runs just the input side, and each of its nodes computes only the gradients it
must pass on (a linear layer's ``dX``, not its ``dW``). Before that, a hook on each input-side node
that also feeds the weight side (a "frontier" node) records the gradient flowing into it.

``backward_weight`` later re-enters the kept graph at those frontier nodes with the recorded
gradients and asks for the parameters' gradients only: the engine now runs the frontier node's
weight outputs and the weight side, nothing of the input side twice. Frontier nodes are grouped by
the parameters they reach, one ``torch.autograd.grad`` per group; in the rare group with several
frontier nodes (a weight shared by two layers), a hook pins each frontier node's gradient to the
recorded one, so a path between them is not counted twice. The parameter gradients are added into
``.grad`` (hooks registered on the gradient accumulator do not run; tensor hooks on the parameter do).

A linear layer (``nn.Linear``'s autograd node, ``addmm``/``mm`` of a 2-D input, or of a flattened
3-D one) whose weight side is nothing but its own weight and bias, without tensor hooks, and whose
saved input is not behind saved-tensor hooks (checkpointing, offloading), real and dense, takes a shorter ``W``: its input and the recorded output gradient are kept, and ``W`` adds ``dY^T X`` into the
weight's ``.grad`` with one ``addmm_`` (and ``dY`` summed over rows into the bias's), without a
call into the autograd engine (each costs more than the small matrix product itself) and without
the temporary gradient autograd would make and then add. Hooks registered on the layer's autograd
nodes themselves (``grad_fn.register_hook``, or a tensor hook on ``weight.t()``) are not seen by it and
do not run for ``W``; hooks on the parameters do (such a layer takes the general path).

A node that computes its weight gradients in the same call as its input gradient, whatever it is
asked for (a ``torch.compile``'d region is one such node: its compiled backward gives every
gradient at once), hands them over at ``I`` (a hook after the node records them), and ``W``
starts below it, so the node does not run twice.

Activation checkpointing with ``torch.utils.checkpoint(..., use_reentrant=False)`` works: its
region is recomputed for ``I`` and again for ``W`` (each backward pass recomputes what it unpacks).
The reentrant form runs its own backward inside one node and cannot give an input gradient alone;
it is refused with a message saying so.
"""
import contextlib

import torch

__all__ = ["ParamNodes", "SplitBackward", "backward_input"]


def _node_of(t):
    """The autograd node a gradient for ``t`` flows into (its grad_fn, or a leaf's gradient accumulator)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _marks(roots, inputs, params):
    """{node: (leads to one of ``inputs``, leads to one of ``params``)} for the graph under ``roots``.
    Iterative (graphs of deep stages exceed Python's recursion limit)."""
    memo = {}
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if expanded:
            marks = [memo[c] for c in children if c in memo]
            memo[node] = (node in inputs or any(m[0] for m in marks), node in params or any(m[1] for m in marks))
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in memo)
    return memo


class ParamNodes:
    """The gradient-accumulator node of each parameter, looked up once: holding it keeps autograd
    from making a new one per forward, so the graphs of later micro-batches lead to the same node."""

    def __init__(self):
        self._nodes = {}  # id(param) -> (param, node)

    def __call__(self, params):
        out = {}
        for p in params:
            hit = self._nodes.get(id(p))
            if hit is None or hit[0] is not p:
                hit = self._nodes[id(p)] = (p, _node_of(p))
            out.setdefault(hit[1], p)
        return out


class SplitBackward:
    """What ``I`` keeps of one micro-batch for its ``W``: the frontier nodes (the graph stays alive
    through them) with their recorded gradients, grouped by the parameters they reach."""

    def __init__(self, groups, whole=None, linears=()):
        self.groups = groups  # [(frontier edges [(node, grads tuple)], seed roots [(node, nr, grad)], params)]
        self.whole = whole  # (outputs, grads): no input needed a gradient, so W is the whole backward
        self.linears = linears  # [(input X, output gradient dY, weight, bias or None)]: W is dY^T X

    def run(self):
        """Adds this micro-batch's parameter gradients into ``.grad`` (the ``W`` action)."""
        if self.whole is not None:
            outputs, grads = self.whole
            self.whole = None
            torch.autograd.backward(outputs, grads)
            return
        linears, self.linears = self.linears, ()
        if linears:
            device = linears[0][0].device.type
            # autocast around W would make the products in its dtype, not the parameters'
            with torch.no_grad(), torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else \
                    contextlib.nullcontext():
                for x, dy, weight, bias in linears:
                    _accumulate(weight, dy.t(), x)
                    if bias is not None:
                        _accumulate(bias, dy.sum(0))
        groups, self.groups = self.groups, None
        for i, (frontier, seeds, params) in enumerate(groups):
            outputs, grads = [], []
            for node, recorded in frontier:
                for nr, g in enumerate(recorded):
                    if g is not None:
                        outputs.append(torch.autograd.graph.GradientEdge(node, nr))
                        grads.append(g)
            for node, nr, g in seeds:
                outputs.append(torch.autograd.graph.GradientEdge(node, nr))
                grads.append(g)
            if not outputs:
                continue
            pins = []
            if len(frontier) > 1:  # a frontier node below another gets exactly its recorded gradient
                pins = [node.register_prehook(lambda _g, rec=recorded: rec) for node, recorded in frontier]
            try:
                dws = torch.autograd.grad(outputs, params, grads, retain_graph=i + 1 < len(groups), allow_unused=True)
            finally:
                for h in pins:
                    h.remove()
            with torch.no_grad():
                for p, g in zip(params, dws):
                    if g is not None:
                        _accumulate(p, g)


def _accumulate(p, g, x=None):
    """``p.grad += g`` (``g @ x`` when ``x`` is given, in one ``addmm_``), or ``p.grad = ...`` when it has none."""
    if p.grad is None:
        p.grad = g if x is None else torch.mm(g, x)
    elif x is None:
        p.grad.add_(g)
    elif p.grad.layout == torch.strided and p.grad.dtype == g.dtype:
        p.grad.addmm_(g, x)
    else:  # a gradient of another layout or dtype, added to as the general path does
        p.grad.add_(torch.mm(g, x))


def _reentrant_checkpoint(err):
    return "checkpoint" in str(err).lower() and ".grad()" in str(err)


def backward_input(outputs, output_grads, inputs, params, param_nodes=None):
    """The ``I`` action of one micro-batch.

    outputs: the stage's output tensors (or the loss) that gradients flow from; output_grads: their
    gradients (None for a scalar loss). inputs: the stage's input tensors (leaves; those that do
    not require grad get no gradient). params: the stage's parameters that require grad.
    param_nodes: a :class:`ParamNodes` kept by the caller across micro-batches (looked up anew
    when None).

    Returns (input gradients, one per tensor of ``inputs``, None where there is none; the
    :class:`SplitBackward` that computes the parameter gradients later).
    """
    pairs = [(o, torch.ones_like(o) if g is None else g) for o, g in zip(outputs, output_grads)
             if o.requires_grad]
    if not pairs:
        return [None] * len(inputs), SplitBackward([])
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:  # a first stage: nothing to send back, the whole backward is W's
        return [None] * len(inputs), SplitBackward([], whole=([o for o, _ in pairs], [g for _, g in pairs]))
    roots = [(_node_of(o), o.output_nr if o.grad_fn is not None else 0, g) for o, g in pairs]
    input_nodes = {_node_of(t) for t in wanted}
    param_nodes = (param_nodes or ParamNodes())(params)
    root_nodes = [n for n, _, _ in roots]
    marks = _marks(root_nodes, input_nodes, param_nodes)
    to_input = {n: m[0] for n, m in marks.items()}
    to_param = {n: m[1] for n, m in marks.items()}

    # frontier: input-side nodes with an edge into the weight side; seeds: weight-only roots
    def weight_side(c):
        return c is not None and not to_input.get(c, False) and to_param.get(c, False)

    frontier = [n for n, on_input in to_input.items()
                if on_input and n not in input_nodes and any(weight_side(c) for c, _ in n.next_functions)]
    seeds = [(n, nr, g) for n, nr, g in roots if not to_input.get(n, False) and to_param.get(n, False)]
    recorded, computed = {}, {}
    hooks = [n.register_prehook(lambda grads, n=n: recorded.__setitem__(n, grads)) for n in frontier]
    # only custom Functions may ignore which gradients are needed (built-in nodes compute just those)
    hooks += [n.register_hook(lambda grads_in, _out, n=n: computed.__setitem__(n, grads_in)) for n in frontier
              if isinstance(n, torch.autograd.function.BackwardCFunction)]
    try:
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], retain_graph=True,
                                    allow_unused=True)
    except RuntimeError as err:
        if _reentrant_checkpoint(err):
            raise ValueError("a zero-bubble schedule splits the backward into input and weight gradients, which "
                             "torch.utils.checkpoint(use_reentrant=True) cannot do (it runs the whole backward of its "
                             "region in one step); use checkpoint(..., use_reentrant=False), or a schedule without "
                             "I/W actions") from err
        raise
    finally:
        for h in hooks:
            h.remove()
    for o, _ in pairs:  # the graph above the frontier is not needed any more (W re-enters below it)
        try:
            o.detach_()
        except RuntimeError:  # a view cannot be detached in place; it is dropped with the caller's references
            pass
    # A frontier node that computed its weight-side gradients anyway (a torch.compile'd region is one
    # node whose compiled backward gives every gradient at once; so may a custom Function) hands them
    # over: W starts below it instead of running it a second time.
    for n in frontier:
        grads_in = computed.get(n)
        if grads_in is None or n not in recorded:
            continue
        edges = [(j, c, nr) for j, (c, nr) in enumerate(n.next_functions) if weight_side(c)]
        if all(grads_in[j] is not None for j, _, _ in edges):
            seeds.extend((c, nr, grads_in[j]) for j, c, nr in edges)
            del recorded[n]
    by_input = dict(zip(map(id, wanted), grads))
    input_grads = [by_input.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs]
    groups, linears = [], []
    for group in _group(frontier, recorded, seeds, param_nodes, to_input, to_param):
        linear = _as_linear(group)
        if linear is None:
            groups.append(group)
        elif linear:  # an empty tuple: no gradient reached the layer, nothing to add
            linears.append(linear)
    return input_grads, SplitBackward(groups, linears=linears)


_LINEAR_NODES = {"AddmmBackward0": ("_saved_mat1", 1, 2), "MmBackward0": ("_saved_self", 0, 1)}


def _as_linear(group):
    """(X, dY, weight, bias) when ``group`` is one linear layer's weight side: a single frontier node
    ``addmm(bias, X, weight.t())`` (alpha = beta = 1) or ``mm(X, weight.t())`` of 2-D matrices whose
    weight-side edges lead straight to the gradient accumulators of ``weight`` (through the
    transpose) and ``bias``, which are the group's parameters and have no tensor hooks; ``()`` when
    no gradient reached it; None otherwise (the group takes the general path)."""
    frontier, seeds, params = group
    if seeds or len(frontier) != 1:
        return None
    node, recorded = frontier[0]
    kind = _LINEAR_NODES.get(type(node).__name__)
    if kind is None or len(recorded) != 1:
        return None
    saved, x_edge, w_edge = kind
    edges = node.next_functions
    if kind[0] == "_saved_mat1" and (node._saved_alpha != 1 or node._saved_beta != 1):
        return None
    t_node = edges[w_edge][0]
    if t_node is None or type(t_node).__name__ != "TBackward0":
        return None
    weight = _leaf(t_node.next_functions[0][0])
    bias = _leaf(edges[0][0]) if x_edge == 1 else None
    if weight is None or (x_edge == 1 and edges[0][0] is not None and bias is None):
        return None
    wanted = {id(weight)} | ({id(bias)} if bias is not None else set())
    if {id(p) for p in params} != wanted or any(p._backward_hooks for p in params):
        return None
    if getattr(getattr(node, "_raw" + saved), "unpack_hook", True) is not None:
        return None  # behind saved-tensor hooks (checkpointing recomputes it, offloading fetches it)
    dy = recorded[0]
    if dy is None:
        return ()
    x = getattr(node, saved)
    if x.dim() != 2 or dy.dim() != 2 or x.dtype != weight.dtype or dy.dtype != weight.dtype or weight.dim() != 2:
        return None
    if weight.is_complex() or x.layout != torch.strided or dy.layout != torch.strided:
        return None  # complex: dW is dY^T conj(X)
    if any(getattr(p, "grad_dtype", None) not in (None, p.dtype) for p in params):
        return None
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != dy.shape[1]):
        return None
    return x, dy, weight, bias


def _leaf(node):
    """The parameter a gradient accumulator node accumulates into, or None for any other node."""
    if node is None or type(node).__name__ != "AccumulateGrad":
        return None
    return node.variable


def _group(frontier, recorded, seeds, param_nodes, to_input, to_param):
    """Groups frontier nodes and seed roots that reach a common parameter through the weight side
    (union-find over parameters): [(frontier [(node, recorded grads)], seeds, params), ...]."""
    starts = [("f", n) for n in frontier if n in recorded] + [("s", s) for s in seeds]
    reach = []
    for kind, item in starts:
        node = item if kind == "f" else item[0]
        found, stack, seen = set(), [node], {node}
        while stack:
            cur = stack.pop()
            if cur in param_nodes:
                found.add(cur)
                continue
            for c, _ in cur.next_functions:
                # the weight side only: input-side children ran in I, and lead to other frontier nodes
                if c is None or c in seen or to_input.get(c, False) or not to_param.get(c, False):
                    continue
                seen.add(c)
                stack.append(c)
        reach.append(found)
    parent = list(range(len(starts)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner = {}
    for i, found in enumerate(reach):
        for pn in found:
            if pn in owner:
                parent[root(i)] = root(owner[pn])
            else:
                owner[pn] = i
    groups = {}
    for i, (kind, item) in enumerate(starts):
        g = groups.setdefault(root(i), ([], [], set()))
        if kind == "f":
            g[0].append((item, recorded[item]))
        else:
            g[1].append(item)
        g[2].update(reach[i])
    return [(f, s, [param_nodes[pn] for pn in pns]) for f, s, pns in groups.values() if pns]
