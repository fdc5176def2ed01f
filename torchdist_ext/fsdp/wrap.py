"""Which submodules become their own sharded unit (auto_wrap_policy), and which parameters each
unit owns.

A policy is called as torch's are: ``policy(module=m, recurse=False, nonwrapped_numel=n)`` returns
True when ``m`` should be its own unit, ``n`` being the number of parameters in ``m``'s subtree not
already owned by a unit chosen below it (modules are visited bottom-up). So torch's
``ModuleWrapPolicy`` and ``size_based_auto_wrap_policy`` work too, and so do ours below.
"""

from torch import nn

__all__ = ["ModuleWrapPolicy", "size_based_auto_wrap_policy"]


class ModuleWrapPolicy:
    """Every submodule that is an instance of one of ``module_classes`` becomes a unit."""

    def __init__(self, module_classes):
        classes = tuple(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(f"ModuleWrapPolicy: module_classes must be nn.Module subclasses, got {module_classes!r}")
        self.module_classes = classes

    def __call__(self, module, recurse, nonwrapped_numel=0, **kwargs):
        return True if recurse else isinstance(module, self.module_classes)

    def __repr__(self):
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


def size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=int(1e8), **kwargs):
    """A submodule becomes a unit once it holds at least ``min_num_params`` parameters not owned by
    units below it. Bind the threshold with ``functools.partial(size_based_auto_wrap_policy,
    min_num_params=N)``."""
    return True if recurse else nonwrapped_numel >= min_num_params


def _as_policy(policy):
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, (set, list, tuple, frozenset)):
        return ModuleWrapPolicy(policy)
    raise TypeError(f"FullyShardedDataParallel: auto_wrap_policy must be a callable (e.g. ModuleWrapPolicy, "
                    f"functools.partial(size_based_auto_wrap_policy, min_num_params=N)) or a set of module "
                    f"classes, got {type(policy).__name__}")


def choose_units(root, policy):
    """Submodules chosen by ``policy`` (bottom-up, root excluded) plus ``root`` last."""
    policy = _as_policy(policy)
    chosen = []
    if policy is not None:
        def visit(module, is_root):
            numel = sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():
                numel += visit(child, False)
            if not is_root and numel > 0 and policy(module=module, recurse=False, nonwrapped_numel=numel):
                chosen.append(module)
                return 0
            return numel

        visit(root, True)
    chosen.append(root)
    return chosen


class UnitParams:
    """The parameters one unit owns: each distinct parameter once, with every (module, attribute)
    that holds it (tied weights inside one unit share one slot) and its names in the root."""

    def __init__(self):
        self.params = []   # distinct nn.Parameter objects, flat order
        self.holders = []  # per parameter: [(module, attribute name)]
        self.names = []    # per parameter: [fully qualified names in the root module]


def collect_unit_params(root, unit_modules):
    """Assigns every parameter of ``root`` to the innermost unit containing it.

    Raises ValueError when a parameter is shared across units, or when a unit mixes parameters
    that require grad with frozen ones, or mixes dtypes or devices.
    """
    unit_of = {id(m): i for i, m in enumerate(unit_modules)}
    result = [UnitParams() for _ in unit_modules]
    owner = {}  # id(param) -> (unit index, first name)
    root_index = unit_of[id(root)]

    def walk(module, prefix, unit):
        unit = unit_of.get(id(module), unit)
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = prefix + attr
            if id(p) in owner:
                other_unit, other_name = owner[id(p)]
                if other_unit != unit:
                    raise ValueError(
                        f"FullyShardedDataParallel: parameter {name!r} is the same tensor as {other_name!r}, but the "
                        f"two live in different wrapped units ({_describe(unit_modules[unit])} and "
                        f"{_describe(unit_modules[other_unit])}); shared parameters must stay inside one unit: change "
                        "auto_wrap_policy so one unit contains both modules")
                slot = result[unit].params.index(p)
                result[unit].holders[slot].append((module, attr))
                result[unit].names[slot].append(name)
                continue
            owner[id(p)] = (unit, name)
            result[unit].params.append(p)
            result[unit].holders.append([(module, attr)])
            result[unit].names.append([name])
        for child_name, child in module.named_children():
            walk(child, prefix + child_name + ".", unit)

    walk(root, "", root_index)
    for i, up in enumerate(result):
        trainable = [n[0] for p, n in zip(up.params, up.names) if p.requires_grad]
        frozen = [n[0] for p, n in zip(up.params, up.names) if not p.requires_grad]
        if trainable and frozen:
            raise ValueError(
                f"FullyShardedDataParallel: unit {_describe(unit_modules[i])} would put frozen parameters {frozen} "
                f"into one flat parameter with trainable ones {trainable}; a flat parameter is either trained or "
                "frozen as a whole: wrap the frozen modules as units of their own (auto_wrap_policy) or set "
                "requires_grad the same for all of them")
        for what, values in (("dtypes", {p.dtype for p in up.params}), ("devices", {p.device for p in up.params})):
            if len(values) > 1:
                raise ValueError(f"FullyShardedDataParallel: unit {_describe(unit_modules[i])} mixes parameter "
                                 f"{what} {sorted(map(str, values))}; one flat parameter holds one dtype on one device")
    return result


def _describe(module):
    return type(module).__name__


