#!/usr/bin/env bash
# Session 6, call 5 (tree 87bed5d + round6 scripts): vLLM 0.26.0 and ladle (defaults) served side by side on SmolLM2
# shapes: the same script as round 5 call F2.
bash benchmarks/results/round5/scripts/f2.sh
