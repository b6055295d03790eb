"""Tensor parallelism over torch.distributed: sharding from outside the decoder, ranks, per-step broadcast."""
from kvinfer.parallel.runtime import (TensorParallel, TensorParallelError, TPModelRunner, is_worker_process,
                                      refuse_spawn_bootstrap, refuse_unguarded_main, run_worker_node)
from kvinfer.parallel.shard import check_tp_size, kv_heads_per_rank, local_config, shard_decoder, valid_sizes

__all__ = ["TensorParallel", "TensorParallelError", "TPModelRunner", "is_worker_process", "refuse_spawn_bootstrap",
           "refuse_unguarded_main", "run_worker_node", "check_tp_size", "kv_heads_per_rank", "local_config", "shard_decoder", "valid_sizes"]
