"""Test drivers: run a model on a paged KV cache without the runner or the scheduler (importable from any test,
as tests/ is on sys.path through tests/conftest.py).

  minimax_m3_paged.PagedDriver, load_m3_dir — MiniMax-M3 checkpoints, block allocator, greedy steps.
  paged_test_cache.PagedTestCache — any model from its kv_cache_specs(), ragged chunks per step.
"""
