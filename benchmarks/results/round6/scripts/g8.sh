#!/usr/bin/env bash
# Session 6, call 8: the MoE combine tile sweep (g8_combine_sweep.py).
PYTHONPATH=$PWD timeout 200 python3 benchmarks/results/round6/scripts/g8_combine_sweep.py 2>&1 | tail -24
