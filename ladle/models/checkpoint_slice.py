"""A lazy view of one safetensors tensor, so a tensor-parallel rank reads only the slices it keeps.

`CheckpointSlice(handle, name)` wraps safetensors' `safe_open(...).get_slice(name)` (header read only). The layer
kit's weight_loaders slice checkpoint tensors with `narrow`, `split`, `x[i]` / `x[a:b]` and cast them with `.to`;
on a CheckpointSlice these only narrow the index (no I/O). Anything else a loader does with it (`copy_` into a
parameter, `repeat_interleave`, `reshape`, ...) goes through `__torch_function__` / `__getattr__`, which read the
indexed region from the file (`materialize`) and run the torch op on that tensor. So the loaders keep their one
slicing code path, and a replicated parameter or a whole-tensor load simply reads the whole tensor.

The object is valid while its `safe_open` handle is open: the loader consumes each tensor as it is yielded.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# safetensors dtype names (the format's header spec) -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointSlice:
    """A region of checkpoint tensor `name` in an open safetensors `handle`, read on demand.

    base_shape: the stored tensor's shape; ranges: per stored dim [start, stop); dropped: stored dims removed by an
    integer index (x[e]); cast: dtype the materialized tensor is converted to (None: the stored dtype).
    `shape` / `dtype` / `dim()` / `numel()` describe the view as a torch tensor of it would be.
    """

    def __init__(self, handle: Any, name: str, base_shape: Optional[tuple[int, ...]] = None,
                 ranges: Optional[tuple[tuple[int, int], ...]] = None, dropped: Optional[tuple[bool, ...]] = None,
                 cast: Optional[torch.dtype] = None) -> None:
        self._handle, self._name = handle, name
        if base_shape is None:
            view = handle.get_slice(name)
            base_shape, self._stored_dtype = tuple(view.get_shape()), _ST_DTYPES[view.get_dtype()]
        else:
            self._stored_dtype = None
        self._base_shape = tuple(base_shape)
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in self._base_shape)
        self._dropped = dropped if dropped is not None else (False,) * len(self._base_shape)
        self._cast = cast

    # -- tensor-like description ---------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for (a, b), d in zip(self._ranges, self._dropped) if not d)

    @property
    def dtype(self) -> torch.dtype:
        return self._cast or self._stored_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"CheckpointSlice({self._name!r}, ranges={self._ranges}, shape={tuple(self.shape)}, dtype={self.dtype})"

    # -- lazy indexing (no I/O) ----------------------------------------------------------------------
    def _derive(self, ranges=None, dropped=None, cast=None) -> "CheckpointSlice":
        out = CheckpointSlice(self._handle, self._name, self._base_shape, ranges or self._ranges,
                              dropped or self._dropped, cast or self._cast)
        out._stored_dtype = self._stored_dtype
        return out

    def _stored_dim(self, dim: int) -> int:
        visible = [i for i, d in enumerate(self._dropped) if not d]
        return visible[dim]  # IndexError for a dim out of range, like torch

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        """Rows `start : start + length` of `dim` (torch.narrow semantics, negative dim allowed)."""
        n = self.shape[dim]
        if start < 0:
            start += n
        if not (0 <= start and length >= 0 and start + length <= n):
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        k = self._stored_dim(dim if dim >= 0 else dim + self.ndim)
        ranges = list(self._ranges)
        first = ranges[k][0] + start
        ranges[k] = (first, first + length)
        return self._derive(ranges=tuple(ranges))

    def split(self, split_size, dim: int = 0) -> tuple["CheckpointSlice", ...]:
        """torch.split: an int chunk size or a list of sizes along `dim`."""
        n = self.shape[dim]
        sizes = [min(split_size, n - s) for s in range(0, n, split_size)] if isinstance(split_size, int) \
            else list(split_size)
        if sum(sizes) != n:
            raise RuntimeError(f"split sizes {sizes} do not sum to {n} (dim {dim})")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, m) for s, m in zip(starts, sizes))

    def __getitem__(self, index):
        """x[i] (drops dim 0) and x[a:b] (step 1) lazily; any other index reads the region first."""
        if isinstance(index, int):
            n = self.shape[0]
            i = index + n if index < 0 else index
            if not 0 <= i < n:
                raise IndexError(f"index {index} out of range for dim 0 of size {n}")
            k = self._stored_dim(0)
            ranges, dropped = list(self._ranges), list(self._dropped)
            ranges[k] = (ranges[k][0] + i, ranges[k][0] + i + 1)
            dropped[k] = True
            return self._derive(ranges=tuple(ranges), dropped=tuple(dropped))
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.shape[0])
            return self.narrow(0, start, max(stop - start, 0))
        return self.materialize()[index]

    def to(self, *args, **kwargs):
        """A dtype-only `.to(dtype)` stays lazy; anything else (a device, ...) reads the region first."""
        dtype = kwargs.get("dtype", args[0] if len(args) == 1 and not kwargs else None)
        if isinstance(dtype, torch.dtype) and set(kwargs) <= {"dtype"}:
            return self if dtype == self.dtype else self._derive(cast=dtype)
        return self.materialize().to(*args, **kwargs)

    # -- reading -------------------------------------------------------------------------------------
    def materialize(self) -> torch.Tensor:
        """The indexed region as a CPU tensor of `dtype` (only that region is read from the file)."""
        t = self._read()
        return t if self._cast is None or t.dtype == self._cast else t.to(self._cast)

    def _read(self) -> torch.Tensor:
        if all(r == (0, n) for r, n in zip(self._ranges, self._base_shape)):
            t = self._handle.get_tensor(self._name)
        else:
            t = self._handle.get_slice(self._name)[tuple(slice(a, b) for a, b in self._ranges)]
        drop = [k for k, d in enumerate(self._dropped) if d]
        return t.reshape(self.shape) if drop else t

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            if isinstance(x, CheckpointSlice):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(v) for v in x)
            return x

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})
