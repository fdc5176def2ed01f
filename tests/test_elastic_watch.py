"""The liveness watch says why a rank's key in etcd went (torchdist_ext/elastic/_watch.py): a lease
that the other ranks revoked when they excluded the rank (``_liveness.revoke``, the trainers'
recovery) is told with their reason, not as an expired lease; a lease that nobody refreshed is told
as expired. One local etcd member, one rank keeping its liveness key, and a second watch reading
it as a rank of another host would."""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _dist import run_ranks
from _etcd import LocalEtcd

WHY = "rank 0 was excluded from the group after making no progress for 5 s"


def _wait_gone(store, key, timeout=30):
    deadline = time.monotonic() + timeout
    while store.check([key]):
        assert time.monotonic() < deadline, f"{key} is still in etcd"
        time.sleep(0.05)


def _revoked_body(rank, ws, url):
    from torchdist_ext.elastic import _liveness, _watch
    from torchdist_ext.etcd_store import EtcdStore

    store = EtcdStore(url, timeout=30)
    dist.init_process_group("tdx", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=30))
    assert _liveness.start()
    observer = _watch.Watch(store, rank=7, host="another-host", ttl=_liveness.detection_seconds())
    observer._resync()  # knows rank 0's key, as the ranks of the other hosts do

    # A key nobody refreshes: its lease expires.
    lease = store._client.lease(1)
    store._client.put(store._key(_watch.alive_key(0, 3)), b'{"host": "hostC"}', lease=lease)
    observer._resync()

    # The others exclude rank 0 (here it revokes its own lease, as they would).
    _liveness.revoke(None, {0: WHY})
    _wait_gone(store, _watch.alive_key(0, 0))
    observer._deleted(0)
    _wait_gone(store, _watch.alive_key(0, 3))
    observer._deleted(3)
    gone = dict(observer.gone)
    dist.destroy_process_group()
    return gone


def test_a_revoked_lease_is_told_with_the_reason_and_an_expired_one_as_expired():
    from _etcd import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    etcd = LocalEtcd()
    try:
        (gone,) = run_ranks(_revoked_body, 1, etcd.url, backend=None, env={"TDX_FAILURE_DETECTION_S": 2},
                            timeout=120)
    finally:
        etcd.close()
    assert gone[0] == f"the others excluded it ({WHY})", gone
    assert "liveness lease in etcd expired" in gone[3] and "'hostC'" in gone[3], gone
