"""Quantized compute: quant methods for the layer kit's `quant_method` slot and the choice of one from the model's
checkpoint and flags (ladle/quant/config.py)."""
