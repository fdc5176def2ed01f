"""Splitting an ``nn.Sequential`` into balanced pipeline stages."""
import statistics
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["split_sequential", "balance"]


def balance(costs, num_parts):
    """Contiguous split of ``costs`` into ``num_parts`` non-empty parts minimizing the largest part's sum.

    Returns the part sizes (number of items per part).
    """
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages; use 1 to {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-part cost splitting the first i items into k parts; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _param_costs(layers):
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def _time_costs(layers, example_input, repeats):
    """Median forward + backward time of each layer on the activations the example input produces."""
    costs = []
    x = example_input
    for layer in layers:
        times = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(inp)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        costs.append(statistics.median(times[1:]))
        with torch.no_grad():
            x = layer(x)
    return costs


def split_sequential(model, num_stages, by="params", example_input=None, repeats=5, group=None):
    """Splits ``model`` (an ``nn.Sequential``) into ``num_stages`` contiguous ``nn.Sequential`` stages.

    Args:
        model: the sequential model; its layers are shared, not copied (layer names are kept, so
            a stage's state_dict keys match the full model's).
        num_stages: how many stages (1 to the number of layers).
        by: ``"params"`` balances the parameter count; ``"time"`` balances the measured forward +
            backward time of each layer on ``example_input`` (a batch for the first layer).
        repeats: timed repetitions per layer for ``by="time"`` (median taken).
        group: with ``by="time"`` under an initialized process group, the split measured on the
            group's first rank is broadcast so that every rank cuts the model at the same places
            (every rank of the group must then call this function).

    Returns:
        a list of ``num_stages`` ``nn.Sequential`` modules; stage ``i`` is the i-th.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential: model must be an nn.Sequential, got {type(model).__name__}; wrap your "
                        "layers in nn.Sequential or build the stages yourself")
    names, layers = zip(*model.named_children()) if len(model) else ((), ())
    if not isinstance(num_stages, int) or not 1 <= num_stages <= len(layers):
        raise ValueError(f"split_sequential: num_stages must be an int from 1 to the number of layers "
                         f"({len(layers)}), got {num_stages!r}")
    if by == "params":
        sizes = balance(_param_costs(layers), num_stages)
    elif by == "time":
        if not isinstance(example_input, torch.Tensor):
            raise ValueError("split_sequential(by='time') needs example_input=<a batch tensor for the first layer> to "
                             "time each layer")
        sizes = balance(_time_costs(layers, example_input, repeats), num_stages)
        if dist.is_initialized():
            obj = [sizes]
            src = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast_object_list(obj, src=src, group=group)
            sizes = obj[0]
    else:
        raise ValueError(f"split_sequential: by must be 'params' or 'time', got {by!r}")
    stages, start = [], 0
    for size in sizes:
        stages.append(nn.Sequential(OrderedDict(zip(names[start:start + size], layers[start:start + size]))))
        start += size
    return stages
