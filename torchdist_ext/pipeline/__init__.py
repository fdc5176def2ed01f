"""Pipeline parallelism: a model split into stages, micro-batches kept flowing with GPipe, 1F1B or
zero-bubble schedules.

The API mirrors ``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (ZB-H1),
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, ``.step(*inputs, target=..., losses=[...])``) and
runs on any c10d backend (tdx, gloo, nccl) through asynchronous isend/irecv. Schedules are data:
``schedule.pipeline_order`` is ``{rank: [Action, ...]}``, and ``ScheduleCustom`` runs one given as
text; ``split_sequential`` balances an
``nn.Sequential`` into stages by parameter count or by measured time.
"""
from ._actions import Action, ActionType, format_schedule, parse_schedule
from ._simulate import ScheduleError, simulate
from .schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleGPipe,
                        ScheduleInterleaved1F1B)
from .split import split_sequential
from .stage import PipelineStage
from .zero_bubble import ScheduleCustom, ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

__all__ = ["Action", "ActionType", "PipelineScheduleMulti", "PipelineScheduleSingle", "PipelineStage",
           "Schedule1F1B", "ScheduleCustom", "ScheduleDualPipeV", "ScheduleError", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "format_schedule",
           "parse_schedule", "simulate", "split_sequential"]
