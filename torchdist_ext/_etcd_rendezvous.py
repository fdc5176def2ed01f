"""torchrun's rendezvous kept in an etcd v3 cluster: the ``etcd-v3`` rendezvous backend.

torchrun's ``c10d`` rendezvous keeps its state in a ``TCPStore`` on the ``--rdzv-endpoint`` host:
when that host goes, every other agent fails with ``RendezvousConnectionError`` and stops its
workers. torch's own etcd backends (``etcd``, ``etcd-v2``) speak etcd's v2 API, which etcd 3.4
serves only with ``--enable-v2`` and 3.6 no longer has. This backend is torch's
``DynamicRendezvousHandler`` (the one behind ``c10d``) over a ``RendezvousBackend`` that keeps the
state in one etcd v3 key, compare-and-set on its revision (the fencing token), and hands
``EtcdStore`` (``torchdist_ext.etcd_store``) to the agents as their store:

    python -m torchdist_ext.run --rdzv-backend=etcd-v3 --rdzv-endpoint=hostA:2379,hostB:2379,hostC:2379 \\
        --rdzv-id=myjob --nnodes=3 --nproc-per-node=2 train.py

``torchdist_ext.run`` registers it (and sets ``TDX_STORE`` for the workers, so that
``init_distributed`` puts their group's store in the same cluster); an installed torchdist_ext also
registers it for plain torchrun through the ``torchrun.handlers`` entry point.
"""
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler

from .etcd_store import EtcdStore, _with_failover

__all__ = ["EtcdV3RendezvousBackend", "create_etcd_v3_handler", "handler_generator", "register", "store_url"]

BACKEND_NAME = "etcd-v3"
_CALL_TIMEOUT = 30.0  # seconds a rendezvous call keeps trying while no member answers


def store_url(endpoint, run_id, what):
    """``etcd://<endpoint>/torchdist_ext/<run_id>/<what>``: the key prefix of one run's ``what``."""
    if not endpoint:
        raise ValueError("--rdzv-backend=etcd-v3 needs --rdzv-endpoint=host1:2379,host2:2379,host3:2379 "
                         "(every member of the etcd cluster)")
    return f"etcd://{endpoint}/torchdist_ext/{run_id}/{what}"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The rendezvous state in one etcd key; its ``mod_revision`` is the fencing token.

    Args:
        store: an ``EtcdStore`` (its client and members are used; the key lives under its prefix).
    """

    def __init__(self, store):
        self._store = store
        self._key = store._key("rendezvous-state")

    @property
    def name(self):
        return BACKEND_NAME

    def _call(self, what, fn, *args, **kwargs):
        try:
            return _with_failover(f"rendezvous {what}", self._store._endpoints, _CALL_TIMEOUT, fn, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - torch's handler expects its own connection error
            raise RendezvousConnectionError(f"torchdist_ext etcd-v3 rendezvous: {what} failed: {e}") from e

    def get_state(self):
        value, meta = self._call("get_state", self._store._client.get, self._key)
        return None if value is None else (value, meta.mod_revision)

    def set_state(self, state, token=None):
        client = self._store._client
        tx = client.transactions
        guard = tx.version(self._key) == 0 if token is None else tx.mod(self._key) == int(token)
        ok, responses = self._call("set_state", client.transaction, compare=[guard],
                                   success=[tx.put(self._key, bytes(state)), tx.get(self._key)],
                                   failure=[tx.get(self._key)])
        kvs = responses[-1]
        if not kvs:  # deleted in between: no state to hand back
            return None
        value, meta = kvs[0]
        return value, meta.mod_revision, ok


def create_etcd_v3_handler(params: RendezvousParameters):
    """torch's ``DynamicRendezvousHandler`` over etcd v3 (``--rdzv-backend=etcd-v3``)."""
    store = EtcdStore(store_url(params.endpoint, params.run_id, "agents"))
    # torch counts an agent dead after keep_alive_max_attempt (3) missed keep-alives: about
    # TDX_FAILURE_DETECTION_S, unless --rdzv-conf says otherwise.
    from .elastic._liveness import detection_seconds

    params.config.setdefault("keep_alive_interval", max(1, round(detection_seconds() / 3)))
    handler = create_handler(store, EtcdV3RendezvousBackend(store), params)
    handler._tdx_store = store  # a store written in Python must outlive the handler's use of it
    return handler


def handler_generator():
    """The ``torchrun.handlers`` entry point: returns the handler's creator."""
    return create_etcd_v3_handler


def register():
    """Registers ``etcd-v3`` with torch's rendezvous registry (once)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if not registry._registry.get(BACKEND_NAME):
        registry.register(BACKEND_NAME, create_etcd_v3_handler)
