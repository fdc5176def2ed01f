"""Pipeline parallelism: a model split into stages, micro-batches kept flowing with GPipe or 1F1B.

The API mirrors ``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``.step(*inputs, target=..., losses=[...])``) and
runs on any c10d backend (tdx, gloo, nccl) through asynchronous isend/irecv. Schedules are data:
``schedule.pipeline_order`` is ``{rank: [Action, ...]}``; ``split_sequential`` balances an
``nn.Sequential`` into stages by parameter count or by measured time.
"""
from ._actions import Action, ActionType, format_schedule, parse_schedule
from ._simulate import ScheduleError, simulate
from .schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B, ScheduleGPipe,
                        ScheduleInterleaved1F1B)
from .split import split_sequential
from .stage import PipelineStage

__all__ = ["Action", "ActionType", "PipelineScheduleMulti", "PipelineScheduleSingle", "PipelineStage",
           "Schedule1F1B", "ScheduleError", "ScheduleGPipe", "ScheduleInterleaved1F1B", "format_schedule",
           "parse_schedule", "simulate", "split_sequential"]
