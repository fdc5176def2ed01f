"""A DP x PP x TP process mesh (TP innermost: consecutive ranks form a tensor-parallel group)."""
import torch.distributed as dist

__all__ = ["Mesh", "init_mesh"]


class Mesh:
    """The groups of one rank in a dp x pp x tp mesh.

    Attributes: ``dp``, ``pp``, ``tp`` (sizes), ``dp_rank``, ``pp_rank``, ``tp_rank`` (this rank's
    coordinates), ``dp_group``, ``pp_group``, ``tp_group`` (process groups holding this rank), and
    ``pp_ranks`` (global ranks of this rank's pipeline, by stage).
    """

    def __init__(self, sizes, coords, groups, pp_ranks):
        self.dp, self.pp, self.tp = sizes
        self.dp_rank, self.pp_rank, self.tp_rank = coords
        self.dp_group, self.pp_group, self.tp_group = groups
        self.pp_ranks = pp_ranks

    def __repr__(self):
        return (f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}; this rank at dp={self.dp_rank}, "
                f"pp={self.pp_rank}, tp={self.tp_rank})")


def _from_device_mesh(dm):
    names = dm.mesh_dim_names or ()
    unknown = [n for n in names if n not in ("dp", "pp", "tp")]
    if not names or unknown:
        raise ValueError(f"init_mesh: a DeviceMesh needs mesh_dim_names drawn from ('dp', 'pp', 'tp'), got {names}")
    sizes, coords, groups = [], [], []
    for n in ("dp", "pp", "tp"):
        if n in names:
            sizes.append(dm.size(names.index(n)))
            coords.append(dm.get_local_rank(n))
            groups.append(dm.get_group(n))
        else:
            sizes.append(1)
            coords.append(0)
            groups.append(None)
    pp_ranks = dist.get_process_group_ranks(groups[1]) if groups[1] is not None else [dist.get_rank()]
    return Mesh(tuple(sizes), tuple(coords), tuple(groups), pp_ranks)


def init_mesh(dp=1, pp=1, tp=1, device_mesh=None):
    """Builds the dp x pp x tp groups over the default process group (or wraps torch's ``DeviceMesh``
    whose dims are named from 'dp', 'pp', 'tp').

    Rank ``r`` sits at ``tp = r % tp``, ``pp = (r // tp) % pp``, ``dp = r // (tp * pp)``: a TP group is
    ``tp`` consecutive ranks (one host's ranks), pipelines are strided by ``tp``. Every rank must
    call this with the same sizes; the sizes are checked before any group is created.
    """
    if device_mesh is not None:
        return _from_device_mesh(device_mesh)
    if not dist.is_initialized():
        raise RuntimeError("init_mesh: call torch.distributed.init_process_group first")
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"init_mesh: {name} must be a positive int, got {v!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp * pp * tp != world:
        raise ValueError(f"init_mesh: dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} but the world size is {world}; "
                         f"choose sizes whose product is {world}")
    coords = (rank // (tp * pp), (rank // tp) % pp, rank % tp)

    def at(d, p, t):
        return (d * pp + p) * tp + t

    mine = [None, None, None]
    # new_group is collective over the world: every rank creates every group, in the same order.
    for axis, outer in ((2, [(d, p) for d in range(dp) for p in range(pp)]),
                        (1, [(d, t) for d in range(dp) for t in range(tp)]),
                        (0, [(p, t) for p in range(pp) for t in range(tp)])):
        for a, b in outer:
            if axis == 2:
                ranks = [at(a, b, t) for t in range(tp)]
            elif axis == 1:
                ranks = [at(a, p, b) for p in range(pp)]
            else:
                ranks = [at(d, a, b) for d in range(dp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = g
    pp_ranks = [at(coords[0], p, coords[2]) for p in range(pp)]
    return Mesh((dp, pp, tp), coords, (mine[0], mine[1], mine[2]), pp_ranks)
