"""One step's point-to-point traffic between stages: asynchronous isend/irecv on any backend.

Every flow (sender stage -> receiver stage, activations or gradients) has its own tag, so a flow's
messages match in order even when two flows share a pair of ranks (interleaved schedules). Shapes:
a receiver that does not know its input shapes learns them from the sender's shape message, which
comes before the first activation of the first step (and of every step while the values are more
than tensors); gradient shapes are the shapes of the stage's own outputs. Once both ends know the
shapes, a step sends none: the first activation of each step carries a one-byte trailer saying
whether the shapes still hold. If they changed, the sender fills the receives posted for the old
shapes with a message whose trailer says so, then sends the shape message and the activations.
"""
import math

import torch
import torch.distributed as dist

from ._actions import RECV_B, RECV_F, SEND_B, SEND_F
from ._lower import peer_of
from ._meta import META_LEN, decode_meta, describe, encode_meta, meta_of
from ._values import OBJECT, Packet, decode_header, rebuild

__all__ = ["StepComm", "posts_from_thread", "posts_receives_early"]


def posts_receives_early(group, device):
    """Whether the schedule posts each receive ahead of its consumer (when its sender starts the
    computation that produces it, by the schedule's simulated timeline; see ``_lower.post_at_producer``).

    True except on tdx with CPU tensors. There a message is complete in the shared-memory ring as
    soon as the sender's progress thread has copied it, whether or not the receive was posted, so
    posting early overlaps nothing; but while a receive is pending, the receiver's progress thread
    polls (spins, then yields) for it, and without a spare core it competes with the computation
    it was meant to overlap (measured with 2 ranks on 2 cores, m = 16: 11-22% more CPU time per
    step for GPipe and 1F1B). Posting right before the consumer is what torch.distributed.pipelining
    does. Other backends (gloo, NCCL) move data into posted receives in the background, so they
    post early; so does a tdx group spanning hosts, whose messages go through Gloo: Gloo starts a
    transfer only once its receive is posted (measured between 2 test hosts at 1 Gbit/s: a 4 MB
    message sent before a 100 ms computation was complete 0.02 ms after it when the receive was posted
    before it, 33 ms after it when posted after it, on tdx and gloo alike).
    """
    from .._backend import spans_hosts

    if dist.get_backend(group) != "tdx" or torch.device(device).type != "cpu":
        return True
    return spans_hosts(group)


def posts_from_thread(group, device):
    """Whether the step's sends and receives are posted from a background thread (``_poster``): on
    Gloo, whose ``isend``/``irecv`` write to a socket in the caller, and on a tdx group spanning hosts
    (whose messages Gloo carries), with CPU tensors; other backends are not measured. Measured on the pipeline-zb benchmark's model, 2 ranks on 2 cores, gloo
    (`scripts/dev/ab_pipeline_zb.py`, docs/bench/pipeline-zb-ab-poster-gloo-2core.txt): the step took
    0.65-1.00x the time of posting them from the schedule's thread in 23 of 24 cells (one 1.21x).
    Not on tdx inside a host, whose ``isend``/``irecv`` only queue the operation for its progress thread."""
    if torch.device(device).type != "cpu":
        return False
    from .._backend import spans_hosts

    backend = str(dist.get_backend(group))
    return "gloo" in backend or (backend == "tdx" and spans_hosts(group))


_SAME, _CHANGED = 0, 1  # the trailer byte of a step's first activation (dynamic boundaries)


def _guessable(meta):
    """Whether a receiver may post the next step's first receive with ``meta`` (known tensor shapes)."""
    return isinstance(meta, list) and len(meta) > 0


def _nbytes(shape_dtype):
    shape, dtype = shape_dtype
    return math.prod(shape) * dtype.itemsize


def _with_trailer(t, flag):
    """``t``'s bytes followed by one flag byte, as one uint8 tensor (one message)."""
    out = torch.empty(t.numel() * t.element_size() + 1, dtype=torch.uint8, device=t.device)
    out[:-1].copy_(t.reshape(-1).view(torch.uint8))
    out[-1] = flag
    return out


def _tag(receiver_stage, activations):
    return 2 * receiver_stage + (0 if activations else 1)


class StepComm:
    """Posts, waits and sends the messages of one step for the stages on this rank.

    Args:
        stages: {stage index: PipelineStage} on this rank.
        placement: ``placement[s]`` is the group rank of stage s (the pipeline's layout).
        static_inputs: {stage index: input meta} for every stage of the pipeline that declared
            ``input_args`` (its sender then sends no shape message).
        shapes: kept by the schedule across steps (what both ends of a dynamic boundary agreed on).
        poster: the schedule's :class:`~._poster.Poster` (see :func:`posts_from_thread`), or None.
    """

    def __init__(self, stages, placement, static_inputs, shapes=None, poster=None):
        self.stages = stages
        self.placement = placement
        self.static_inputs = static_inputs
        # kept across steps: ("sent", sender stage) / ("got", receiver stage) -> the input meta that
        # both ends of a dynamic boundary last agreed on
        self._shapes = {} if shapes is None else shapes
        any_stage = next(iter(stages.values()))
        self.group, self.my_rank = any_stage.group, any_stage.group_rank
        self.device = any_stage.device
        self._poster = poster  # a _poster.Poster of the group, or None: posted from this thread
        self._recvs = {}          # recv action -> (buffers, works)
        self._deferred = {}       # flow tag -> [recv actions not yet posted], in order
        self._learned = {}        # receiver stage -> input meta learned this step
        self._meta_sent = set()   # sender stages that sent this step's first activation
        self._guessed = {}        # first recv action of a step -> meta it was posted with (unconfirmed)
        self._first_posted = set()  # receiver stages whose first RECV_F of the step is posted
        self._local = {}          # recv action -> tensors handed over on this rank
        self._sends = []          # (work, tensors kept alive until it completes)
        self._ready = {}          # recv action -> tensors already waited for (hand_back)

    def _global(self, group_rank):
        if self.group is dist.group.WORLD or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _post_send(self, t, peer, tag):
        """Sends ``t`` to group rank ``peer``: through the group's poster thread where there is one."""
        if self._poster is not None:
            return self._poster.isend(t, peer, tag)
        return dist.isend(t, dst=self._global(peer), group=self.group, tag=tag)

    def _post_recv(self, t, peer, tag):
        if self._poster is not None:
            return self._poster.irecv(t, peer, tag)
        return dist.irecv(t, src=self._global(peer), group=self.group, tag=tag)

    # --- receives ----------------------------------------------------------------------------

    def _recv_meta(self, action):
        """Input meta (RECV_F) or output-gradient meta (RECV_B) of the receiving stage, or None if unknown."""
        if action.type == RECV_F:
            if action.stage in self.static_inputs:
                return self.static_inputs[action.stage]
            return self._learned.get(action.stage)  # None until this step's first activation is confirmed
        meta = self.stages[action.stage].step_output_meta()
        if meta is None or meta == OBJECT:
            return meta
        return [(s, d) for s, d in meta if d.is_floating_point]

    def _flow(self, action):
        return _tag(action.stage, action.type == RECV_F)

    def post_recv(self, action):
        peer, _ = peer_of(action, self.placement)
        if peer == self.my_rank:
            return  # handed over locally by the matching send
        flow = self._flow(action)
        meta = self._recv_meta(action)
        if meta is None and action.type == RECV_F and action.stage not in self._first_posted:
            known = self._shapes.get(("got", action.stage))
            if _guessable(known):  # last step's shapes; the first message's trailer confirms them
                self._first_posted.add(action.stage)
                self._guessed[action] = known
                self._irecv(action, peer, known, trailer=True)
                return
        if action.type == RECV_F:
            self._first_posted.add(action.stage)
        if meta is None or meta == OBJECT or self._deferred.get(flow):
            self._deferred.setdefault(flow, []).append(action)
            return
        self._irecv(action, peer, meta)

    def _irecv(self, action, peer, meta, trailer=False):
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta]
        if trailer:
            bufs[0] = torch.empty(_nbytes(meta[0]) + 1, dtype=torch.uint8, device=self.device)
        works = [self._post_recv(b, peer, self._flow(action)) for b in bufs]
        self._recvs[action] = (bufs, works)

    def hand_back(self, action, tensors):
        """Keeps what :meth:`wait_recv` returned for ``action``, so the next wait_recv returns it again
        (a caller that times the wait apart from the computation)."""
        self._ready[action] = tensors

    def wait_recv(self, action):
        """The tensors of a posted receive, once they have arrived."""
        if action in self._ready:
            return self._ready.pop(action)
        peer, _ = peer_of(action, self.placement)
        if peer == self.my_rank:
            # handed over without a copy (as torch's V schedules do): a new leaf sharing the storage;
            # an in-place op on it fails as on any leaf that requires grad
            got = self._local.pop(action)
            if isinstance(got, Packet):
                return got.args([t.detach() for t in got.tensors])
            return [t.detach() for t in got]
        if action in self._guessed:
            got = self._confirm(action, peer)
            if got is not None:
                return got
        if action not in self._recvs:
            flow = self._flow(action)
            pending = self._deferred.get(flow, [])
            if action not in pending:
                raise RuntimeError(f"internal: {action} was never posted")
            meta = self._recv_meta(action)
            if meta is None:  # activations of a dynamic boundary: the sender's shape message comes first
                buf = torch.empty(META_LEN, dtype=torch.int64)
                self._post_recv(buf, peer, self._flow(action)).wait()
                meta = decode_meta(buf)
                self._learned[action.stage] = self._shapes[("got", action.stage)] = meta
            if meta == OBJECT:  # structure and shapes per micro-batch: one receive at a time, in order
                if pending[0] != action:
                    raise RuntimeError(f"internal: {action} waited for before {pending[0]}")
                pending.pop(0)
                return self._recv_packet(action, peer)
            del self._deferred[flow]
            for a in pending:  # post every deferred receive of this flow, in order
                self._irecv(a, peer, meta)
        bufs, works = self._recvs.pop(action)
        for w in works:
            w.wait()
        return bufs

    def _confirm(self, action, peer):
        """The first activation of a step, received with last step's shapes: its tensors if the trailer
        says those shapes still hold, else None (the receive is deferred again, behind the new shape message)."""
        known = self._guessed.pop(action)
        bufs, works = self._recvs.pop(action)
        for w in works:
            w.wait()
        flow = self._flow(action)
        if int(bufs[0][-1].item()) == _SAME:
            shape, dtype = known[0]
            bufs[0] = bufs[0][:-1].view(dtype).view(shape)
            self._learned[action.stage] = known
            for a in self._deferred.pop(flow, []):
                self._irecv(a, peer, known)
            return bufs
        del self._shapes[("got", action.stage)]  # the sender's shape message comes next
        self._deferred.setdefault(flow, []).insert(0, action)
        return None

    def _recv_packet(self, action, peer):
        """A packet's header then its tensors (RECV_F); or the gradients of a micro-batch whose outputs
        were a packet, shaped like its saved outputs (RECV_B)."""
        tag = self._flow(action)
        if action.type == RECV_B:
            outs = self.stages[action.stage].saved_outputs(action.microbatch)
            meta = [(tuple(t.shape), t.dtype) for t in outs if t.is_floating_point()]
        else:
            length = torch.empty(1, dtype=torch.int64)
            self._post_recv(length, peer, tag).wait()
            data = torch.empty(int(length.item()), dtype=torch.uint8)
            self._post_recv(data, peer, tag).wait()
            spec, slots, meta = decode_header(data)
        self._irecv(action, peer, meta)
        bufs, works = self._recvs.pop(action)
        for w in works:
            w.wait()
        return bufs if action.type == RECV_B else rebuild(spec, slots, bufs)

    # --- sends -------------------------------------------------------------------------------

    def send(self, action, tensors):
        peer, peer_stage = peer_of(action, self.placement)
        recv_type = RECV_F if action.type == SEND_F else RECV_B
        recv_action = type(action)(peer_stage, recv_type, action.microbatch)
        if action.type == SEND_B:
            tensors = [t for t in tensors if t is not None]
        if peer == self.my_rank:
            self._local[recv_action] = tensors if isinstance(tensors, Packet) else list(tensors)
            return
        tag = _tag(peer_stage, action.type == SEND_F)
        dst = peer
        if isinstance(tensors, Packet):
            self._send_packet(action, tensors, peer_stage, dst, tag)
            return
        out = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
        if action.type == SEND_F:
            meta = meta_of(out)
            declared = self.static_inputs.get(peer_stage)
            if declared is not None:
                if meta != declared:
                    raise ValueError(f"stage {action.stage}: micro-batch {action.microbatch} produced {describe(meta)} "
                                     f"but stage {peer_stage} declared input_args {describe(declared)}")
            elif action.stage not in self._meta_sent:
                self._meta_sent.add(action.stage)
                if self._shapes.get(("sent", action.stage)) == meta and _guessable(meta):
                    out = [_with_trailer(out[0], _SAME)] + out[1:]
                else:
                    self._announce(action.stage, meta, dst, tag)
        for t in out:
            self._sends.append((self._post_send(t, dst, tag), out))

    def _send_packet(self, action, packet, peer_stage, dst, tag):
        declared = self.static_inputs.get(peer_stage)
        if declared is not None and declared != OBJECT:
            raise ValueError(f"stage {action.stage}: micro-batch {action.microbatch} produced more than tensors, but "
                             f"stage {peer_stage} declared input_args {describe(declared)}; give it an example of the "
                             "same structure, or no input_args")
        if declared is None and action.stage not in self._meta_sent:
            self._meta_sent.add(action.stage)
            self._announce(action.stage, OBJECT, dst, tag)
        length, data = packet.header(f"stage {action.stage}")
        out = [length, data] + [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in packet.tensors]
        for t in out:
            self._sends.append((self._post_send(t, dst, tag), out))

    def _announce(self, stage, meta, dst, tag):
        """Sends ``meta`` as the shape message of ``stage``'s outputs; when the receiver has posted its
        first receives for the shapes of the last step, first fills them with a "changed" trailer."""
        last = self._shapes.get(("sent", stage))
        if _guessable(last):
            filler = [torch.empty(s, dtype=d, device=self.device) for s, d in last]
            filler[0] = torch.full((_nbytes(last[0]) + 1,), _CHANGED, dtype=torch.uint8, device=self.device)
            for t in filler:
                self._sends.append((self._post_send(t, dst, tag), filler))
        m = encode_meta(meta, f"stage {stage}")
        self._sends.append((self._post_send(m, dst, tag), [m]))
        self._shapes[("sent", stage)] = meta

    def finish(self):
        """Waits for every send of the step (their buffers stay alive until then)."""
        for w, _ in self._sends:
            w.wait()
        self._sends.clear()
        if self._recvs or any(self._deferred.values()) or self._local:
            left = list(self._recvs) + [a for v in self._deferred.values() for a in v] + list(self._local)
            raise RuntimeError(f"internal: receives left at the end of the step: {left}")
