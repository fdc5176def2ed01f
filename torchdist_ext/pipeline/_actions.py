"""The schedule IR: one action = (stage, what, micro-batch), written like torchtitan's CSV tokens.

A schedule is data: ``{rank: [Action, ...]}``, each rank executing its list in order. Compute
actions are ``F`` (forward of a micro-batch through a stage) and ``B`` (its backward).
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

__all__ = ["Action", "ActionType", "FORWARD", "BACKWARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
           "format_schedule", "parse_schedule"]


class ActionType(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self):
        return self.value


FORWARD, BACKWARD = ActionType.FORWARD, ActionType.BACKWARD
SEND_F, RECV_F, SEND_B, RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
COMPUTE = (FORWARD, BACKWARD)
SENDS = (SEND_F, SEND_B)
RECVS = (RECV_F, RECV_B)

_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


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
            raise ValueError(f"cannot parse schedule action {token!r}: expected <stage><F|B|SEND_F|RECV_F|SEND_B|"
                             "RECV_B><microbatch>, e.g. '0F3' or '1RECV_B2'")
        return Action(int(m.group(1)), ActionType(m.group(2)), int(m.group(3)))


def format_schedule(actions_by_rank):
    """One line per rank, tokens separated by spaces (the form tests and docs print)."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in sorted(actions_by_rank.items()))


def parse_schedule(text):
    """Inverse of :func:`format_schedule`."""
    out = {}
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        out[int(head.split()[1])] = [Action.parse(t) for t in body.split()]
    return out
