"""One step's point-to-point traffic between stages: asynchronous isend/irecv on any backend.

Every flow (sender stage -> receiver stage, activations or gradients) has its own tag, so a flow's
messages match in order even when two flows share a pair of ranks (interleaved schedules). Shapes:
a receiver that does not know its input shapes defers its receives until the sender's shape
message (sent before the first activation of every step) has arrived; gradient shapes are the
shapes of the stage's own outputs.
"""
import torch
import torch.distributed as dist

from ._actions import RECV_B, RECV_F, SEND_B, SEND_F
from ._lower import peer_of
from ._meta import META_LEN, decode_meta, describe, encode_meta, meta_of

__all__ = ["StepComm", "posts_receives_early"]


def posts_receives_early(group, device):
    """Whether the schedule posts each receive one compute action ahead of its consumer.

    True except on tdx with CPU tensors. There a message is complete in the shared-memory ring as
    soon as the sender's progress thread has copied it, whether or not the receive was posted, so
    posting early overlaps nothing; but while a receive is pending, the receiver's progress thread
    polls (spins, then yields) for it, and without a spare core it competes with the computation
    it was meant to overlap (measured with 2 ranks on 2 cores, m = 16: 11-22% more CPU time per
    step for GPipe and 1F1B). Posting right before the consumer is what torch.distributed.pipelining
    does. Other backends (gloo, NCCL) move data into posted receives in the background, so they
    post early.
    """
    return not (dist.get_backend(group) == "tdx" and torch.device(device).type == "cpu")


def _tag(receiver_stage, activations):
    return 2 * receiver_stage + (0 if activations else 1)


class StepComm:
    """Posts, waits and sends the messages of one step for the stages on this rank.

    Args:
        stages: {stage index: PipelineStage} on this rank.
        num_stages, num_ranks: the pipeline's layout.
        static_inputs: {stage index: input meta} for every stage of the pipeline that declared
            ``input_args`` (its sender then sends no shape message).
    """

    def __init__(self, stages, num_stages, num_ranks, static_inputs):
        self.stages = stages
        self.num_stages, self.num_ranks = num_stages, num_ranks
        self.static_inputs = static_inputs
        any_stage = next(iter(stages.values()))
        self.group, self.my_rank = any_stage.group, any_stage.group_rank
        self.device = any_stage.device
        self._recvs = {}          # recv action -> (buffers, works)
        self._deferred = {}       # flow tag -> [recv actions not yet posted], in order
        self._learned = {}        # receiver stage -> input meta learned this step
        self._meta_sent = set()   # sender stages that sent this step's shape message
        self._local = {}          # recv action -> tensors handed over on this rank
        self._sends = []          # (work, tensors kept alive until it completes)

    def _global(self, group_rank):
        if self.group is dist.group.WORLD or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # --- receives ----------------------------------------------------------------------------

    def _recv_meta(self, action):
        """Input meta (RECV_F) or output-gradient meta (RECV_B) of the receiving stage, or None if unknown."""
        if action.type == RECV_F:
            if action.stage in self.static_inputs:
                return self.static_inputs[action.stage]
            return self._learned.get(action.stage)
        meta = self.stages[action.stage].step_output_meta()
        return None if meta is None else [(s, d) for s, d in meta if d.is_floating_point]

    def _flow(self, action):
        return _tag(action.stage, action.type == RECV_F)

    def post_recv(self, action):
        peer, _ = peer_of(action, self.num_stages, self.num_ranks)
        if peer == self.my_rank:
            return  # handed over locally by the matching send
        flow = self._flow(action)
        meta = self._recv_meta(action)
        if meta is None or self._deferred.get(flow):
            self._deferred.setdefault(flow, []).append(action)
            return
        self._irecv(action, peer, meta)

    def _irecv(self, action, peer, meta):
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta]
        src = self._global(peer)
        works = [dist.irecv(b, src=src, group=self.group, tag=self._flow(action)) for b in bufs]
        self._recvs[action] = (bufs, works)

    def wait_recv(self, action):
        """The tensors of a posted receive, once they have arrived."""
        peer, _ = peer_of(action, self.num_stages, self.num_ranks)
        if peer == self.my_rank:
            return [t.detach().clone() for t in self._local.pop(action)]
        if action not in self._recvs:
            flow = self._flow(action)
            pending = self._deferred.pop(flow, [])
            if action not in pending:
                raise RuntimeError(f"internal: {action} was never posted")
            meta = self._recv_meta(action)
            if meta is None:  # activations of a dynamic boundary: the sender's shape message comes first
                buf = torch.empty(META_LEN, dtype=torch.int64)
                dist.recv(buf, src=self._global(peer), group=self.group, tag=self._flow(action))
                meta = decode_meta(buf)
                self._learned[action.stage] = meta
            for a in pending:  # post every deferred receive of this flow, in order
                self._irecv(a, peer, meta)
        bufs, works = self._recvs.pop(action)
        for w in works:
            w.wait()
        return bufs

    # --- sends -------------------------------------------------------------------------------

    def send(self, action, tensors):
        peer, peer_stage = peer_of(action, self.num_stages, self.num_ranks)
        recv_type = RECV_F if action.type == SEND_F else RECV_B
        recv_action = type(action)(peer_stage, recv_type, action.microbatch)
        if action.type == SEND_B:
            tensors = [t for t in tensors if t is not None]
        if peer == self.my_rank:
            self._local[recv_action] = list(tensors)
            return
        tag = _tag(peer_stage, action.type == SEND_F)
        dst = self._global(peer)
        out = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
        if action.type == SEND_F:
            meta = meta_of(out)
            declared = self.static_inputs.get(peer_stage)
            if declared is not None:
                if meta != declared:
                    raise ValueError(f"stage {action.stage}: micro-batch {action.microbatch} produced {describe(meta)} "
                                     f"but stage {peer_stage} declared input_args {describe(declared)}")
            elif action.stage not in self._meta_sent:
                m = encode_meta(meta, f"stage {action.stage}")
                self._sends.append((dist.isend(m, dst=dst, group=self.group, tag=tag), [m]))
                self._meta_sent.add(action.stage)
        for t in out:
            self._sends.append((dist.isend(t, dst=dst, group=self.group, tag=tag), out))

    def finish(self):
        """Waits for every send of the step (their buffers stay alive until then)."""
        for w, _ in self._sends:
            w.wait()
        self._sends.clear()
        if self._recvs or any(self._deferred.values()) or self._local:
            left = list(self._recvs) + [a for v in self._deferred.values() for a in v] + list(self._local)
            raise RuntimeError(f"internal: receives left at the end of the step: {left}")
