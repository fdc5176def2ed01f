"""Tensor parallelism (Megatron style) on c10d groups: column/row-parallel linears, a
vocabulary-parallel embedding and cross-entropy, sequence parallelism, ``parallelize_module`` plans
(ours or torch's), and a DP x PP x TP mesh."""
from ._comm import (bytes_communicated, copy_to_region, gather_last_dim, gather_seq, reduce_from_region, reduce_scatter_seq,
                    scatter_last_dim, split_seq)
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_sequence_parallel,
                     share_input_region, vocab_parallel_cross_entropy)
from .checkpoint import merge_shards, shard_state_dict, tp_layout
from .mesh import Mesh, init_mesh
from .plan import broadcast_module, parallelize_module
from . import models

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "mark_sequence_parallel",
           "share_input_region", "tp_layout", "merge_shards", "shard_state_dict",
           "vocab_parallel_cross_entropy", "parallelize_module", "broadcast_module", "Mesh", "init_mesh",
           "copy_to_region", "reduce_from_region", "gather_last_dim", "scatter_last_dim", "gather_seq",
           "reduce_scatter_seq", "split_seq", "models", "bytes_communicated"]
