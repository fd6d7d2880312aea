"""Tensor-parallel process groups and the collectives the layer kit calls (ladle/distributed/parallel_state.py)."""

from ladle.distributed.parallel_state import (WORKER_ENV, all_reduce_min_int, apply_worker_env, destroy_tensor_parallel,
                                              free_port, init_tensor_parallel, tensor_model_parallel_all_gather,
                                              tensor_model_parallel_all_reduce, tp_world_size)

__all__ = ["WORKER_ENV", "all_reduce_min_int", "apply_worker_env", "destroy_tensor_parallel", "free_port",
           "init_tensor_parallel", "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
           "tp_world_size"]
