"""The schedule IR: one action = (stage, what, micro-batch), written like torchtitan's CSV tokens.

A schedule is data: ``{rank: [Action, ...]}``, each rank executing its list in order. Compute
actions are ``F`` (forward of a micro-batch through a stage) and ``B`` (its whole backward), or the
backward split in two as zero-bubble schedules run it (torch.distributed.pipelining's tokens):
``I`` (the gradient of the stage's input, which the previous stage waits for) and ``W`` (the
gradients of the stage's parameters, from what ``I`` kept; any time after it).
Communication actions name the stage that *owns* the tensor on this rank:

- ``SEND_F``: stage ``s`` sends its forward output of micro-batch ``mb`` to stage ``s + 1``;
- ``RECV_F``: stage ``s`` posts the receive of its forward input (from stage ``s - 1``);
- ``SEND_B``: stage ``s`` sends the gradient of its input to stage ``s - 1``;
- ``RECV_B``: stage ``s`` posts the receive of the gradient of its output (from stage ``s + 1``).

Sends and receive postings never block (asynchronous isend/irecv); a compute action waits for the
receive it consumes. ``str(Action(1, FORWARD, 3)) == "1F3"``, ``"2RECV_B0"`` and so on.
"""
import re
from enum import Enum
from typing import NamedTuple

__all__ = ["Action", "ActionType", "FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_F", "RECV_F",
           "SEND_B", "RECV_B", "format_schedule", "parse_schedule"]


class ActionType(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self):
        return self.value


FORWARD, BACKWARD = ActionType.FORWARD, ActionType.BACKWARD
BACKWARD_INPUT, BACKWARD_WEIGHT = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
GRADS_IN = (BACKWARD, BACKWARD_INPUT)  # the actions that consume the output gradient and send the input's
SENDS = (SEND_F, SEND_B)
RECVS = (RECV_F, RECV_B)

_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    stage: int
    type: ActionType
    microbatch: int

    def __str__(self):
        return f"{self.stage}{self.type.value}{self.microbatch}"

    def __repr__(self):
        return str(self)

    @staticmethod
    def parse(token):
        """``"1F3"`` -> Action(1, FORWARD, 3)."""
        m = _TOKEN.match(token.strip())
        if m is None:
            raise ValueError(f"cannot parse schedule action {token!r}: expected <stage><F|B|I|W|SEND_F|RECV_F|"
                             "SEND_B|RECV_B><microbatch>, e.g. '0F3' or '1RECV_B2'")
        return Action(int(m.group(1)), ActionType(m.group(2)), int(m.group(3)))


def format_schedule(actions_by_rank):
    """One line per rank, tokens separated by spaces (the form tests and docs print)."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in sorted(actions_by_rank.items()))


def parse_schedule(text):
    """Inverse of :func:`format_schedule`: lines ``rank <r>: <token> <token> ...`` (blank lines and
    ``#`` comments ignored; tokens may also be separated by commas)."""
    out = {}
    for n, line in enumerate(text.strip().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, colon, body = line.partition(":")
        words = head.split()
        if not colon or len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
            raise ValueError(f"schedule line {n}: {line!r} should read 'rank <r>: <action> <action> ...', e.g. "
                             "'rank 0: 0F0 0F1 0I0 0W0'")
        rank = int(words[1])
        if rank in out:
            raise ValueError(f"schedule line {n}: rank {rank} appears twice")
        out[rank] = [Action.parse(t) for t in body.replace(",", " ").split()]
    return out
