"""Bytes a sharded (or plain) model holds in parameters, gradients and optimizer state."""
import torch

__all__ = ["training_state_bytes"]


def training_state_bytes(model, optimizer=None):
    """{"params", "grads", "optimizer", "total"}: bytes of distinct storages this rank holds.

    For a FullyShardedDataParallel model, params count the shards and each unit's full buffer
    while it is allocated (a stage-1/2 shard that is a view of the full buffer counts once);
    grads count the shards' gradients and any full gradient still held (e.g. under no_sync). For
    any other module, its parameters and their .grad. Optimizer state: every tensor in
    ``optimizer.state``.
    """
    seen = set()

    def nbytes(t):
        if t is None:
            return 0
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes(), t.device)
        if s.nbytes() == 0 or key in seen:
            return 0
        seen.add(key)
        return s.nbytes()

    units = getattr(model, "units", None)
    params = grads = 0
    if units is not None:
        for u in units:
            params += nbytes(u.full) + nbytes(u.shard)
        for u in units:
            grads += nbytes(u.shard.grad) + nbytes(u.full.grad)
    else:
        for p in model.parameters():
            params += nbytes(p)
        for p in model.parameters():
            grads += nbytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    opt += nbytes(v)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
