"""Tensor-parallel ranks read only their slices of a safetensors checkpoint (ladle/models/checkpoint_slice.py).

A tiny Llama (transformers `save_pretrained`, untied, sharded files) and tiny MiniMax-M3 checkpoints (bf16, MXFP8,
MXFP4; ladle/tools/checkpoint_m3.py) are loaded as TP = 2 shards through `load_model`: every rank's parameters equal
those of the full-read path (each tensor read whole, then narrowed by the same weight_loaders), and a byte counter on
`CheckpointSlice._read` shows a rank read well under the checkpoint's bytes (the big matrices split two ways).
"""

from __future__ import annotations

import glob

import pytest
import torch
import transformers
from safetensors import safe_open

from ladle.config import ModelConfig
from ladle.models import loader
from ladle.models.checkpoint_slice import CheckpointSlice
from ladle.models.registry import resolve_model_class
from ladle.models.weights import TPShard
from ladle.layers.quant_slot import quant_config_scope
from ladle.quant.config import quant_config_of

TP = 2
LLAMA = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _checkpoint_bytes(path: str) -> int:
    total = 0
    for f in glob.glob(f"{path}/*.safetensors"):
        with safe_open(f, framework="pt") as h:
            total += sum(h.get_tensor(n).numel() * h.get_tensor(n).element_size() for n in h.keys())
    return total


def _full_read(model_config: ModelConfig, source, tp: TPShard) -> dict[str, torch.Tensor]:
    """The reference: the same shard loaded from whole tensors (`checkpoint_tensors(lazy=False)`)."""
    cls = resolve_model_class(source.architectures)
    with quant_config_scope(quant_config_of(model_config, source.hf_config)):
        model = cls(source.model_hf_config, torch.float32, torch.device("cpu"), tp=tp)
    model.load_weights(loader.checkpoint_tensors(source, lazy=False)[1])
    return model.state_dict()


def _check_ranks(path: str, monkeypatch, max_fraction: float) -> None:
    model_config = ModelConfig(model=path)
    source = loader.resolve_model_source(model_config)
    read = {"bytes": 0, "sliced": 0}
    original = CheckpointSlice._read

    def counting_read(self):
        t = original(self)
        read["bytes"] += t.numel() * t.element_size()
        read["sliced"] += t.numel() < torch.Size(self._base_shape).numel()
        return t

    monkeypatch.setattr(CheckpointSlice, "_read", counting_read)
    total = _checkpoint_bytes(path)
    for rank in range(TP):
        read.update(bytes=0, sliced=0)
        tp = TPShard(rank, TP)
        got = loader.load_model(model_config, source, torch.float32, "cpu", tp=tp).state_dict()
        assert read["sliced"] > 0 and 0 < read["bytes"] < max_fraction * total, (rank, read, total)
        want = _full_read(model_config, source, tp)
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert torch.equal(got[name], w), name


def test_llama_ranks_read_their_slices(tmp_path, monkeypatch):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(glob.glob(f"{tmp_path}/*.safetensors")) > 1
    _check_ranks(str(tmp_path), monkeypatch, 0.55)


@pytest.mark.parametrize("dtype", ["bf16", "mxfp8", "mxfp4"])
def test_minimax_m3_ranks_read_their_slices(tmp_path, monkeypatch, dtype):
    from ladle.tools.checkpoint_m3 import make_checkpoint

    _check_ranks(make_checkpoint(str(tmp_path / "m3"), "tiny", dtype=dtype), monkeypatch, 0.55)


def test_checkpoint_slice_reads_only_its_region(tmp_path):
    """narrow / split / x[i] / x[a:b] / .to(dtype) stay lazy and compose; a torch op reads the indexed region."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)
    f = str(tmp_path / "x.safetensors")
    save_file({"x": x}, f)
    with safe_open(f, framework="pt") as h:
        lazy = CheckpointSlice(h, "x")
        assert lazy.shape == x.shape and lazy.dtype == torch.float64 and lazy.numel() == x.numel()
        part = lazy.to(torch.float32)[1].split([2, 4], dim=0)[1].narrow(1, 3, 4)[1:3]
        assert part._ranges == ((1, 2), (3, 5), (3, 7)) and part.shape == (2, 4)
        dst = torch.empty(2, 4)
        dst.copy_(part)
        assert torch.equal(dst, x[1, 2:6, 3:7][1:3].float())
        assert torch.equal(lazy[-1].repeat_interleave(2, dim=0), x[-1].repeat_interleave(2, dim=0))
        assert torch.equal(torch.zeros(4, 6, 8, dtype=torch.float64).copy_(lazy), x)
        with pytest.raises(IndexError):
            lazy.narrow(2, 5, 4)
