"""Offline tools behind `ladle make-checkpoint`: synthetic MiniMax-M3 checkpoints and their tokenizer.

Tools may import models (they write what the loader reads); nothing in the serving path imports tools.
"""
