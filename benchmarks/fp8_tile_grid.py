"""Candidate tile grids, the row recorder / report and the paste-ready tile-table literal of
benchmarks/gpu_fp8_tiles.py.

Grids, ordered likeliest first (a cut-short sweep measures the head of each list), per M bucket of the tables in
ladle/kernels/fp8_gemm.py (GEMM_TILES) and ladle/kernels/fused_moe.py (MOE_TILES):
  decode (M <= 64): the smallest MMA M tile (16, 32 at M = 32 for the GEMM) and narrow N tiles, so that the weight
                    stream is spread over more CTAs (at M = 1 the 2688-wide GEMM has only 42 CTAs of 64 columns on
                    132 SMs), plus deeper pipelines;
  M <= 256:         16-64 row tiles (M = 128 puts ~5 rows on each of the 129 experts of the MoE);
  prefill:          64-256 x 64-256 tiles; narrower N for the FP8 MoE, whose GEMM 1 keeps two fp32 accumulators
                    plus the unpromoted MMA result of each K step in registers (BM 128 x BN 128 x 3 tiles spill).
Every block size is a power of two >= 16 (tl.dot's smallest tile) and every kernel masks ragged M / N / K, so no
config reads out of bounds; the MoE row tiles come from moe_align run with the same block_m (its padding). Shared
memory stays under the H200's 227 KB per CTA for the 128-wide K steps (stages x (BM x 128 + BK x BN) bytes);
a config over it fails at launch with a Python exception (recorded, not fatal).
MXFP8 steps K by 32 (a quarter of the bytes per step), so its candidates get two more pipeline stages (at most 8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import threading
import time

import torch

from ladle.kernels import fp8_gemm, fused_moe
from ladle.kernels._common import MAX_TOKENS, tile_row

from ladle.kernels.fp8_gemm import GemmTileConfig as G
from ladle.kernels.fused_moe import MoETileConfig as T

GEMM_GRID = {  # bucket bound -> candidates (block_m, block_n, num_warps, num_stages)
    16: [G(16, 32, 4, 4), G(16, 16, 4, 4), G(16, 32, 4, 6), G(16, 64, 4, 6), G(16, 32, 2, 4), G(16, 16, 2, 5),
         G(16, 64, 8, 4), G(16, 128, 4, 4), G(16, 32, 8, 4), G(16, 64, 4, 3)],
    64: [G(32, 32, 4, 4), G(16, 32, 4, 4), G(32, 32, 4, 6), G(32, 64, 4, 6), G(16, 64, 4, 4), G(32, 16, 4, 4),
         G(32, 32, 2, 4), G(32, 128, 4, 4), G(32, 64, 8, 4), G(64, 64, 4, 4)],
    256: [G(64, 64, 4, 4), G(32, 64, 4, 4), G(64, 32, 4, 4), G(128, 64, 8, 3), G(64, 128, 4, 4), G(32, 128, 4, 4),
          G(128, 128, 8, 3), G(64, 64, 4, 6), G(64, 128, 8, 3), G(32, 32, 4, 4)],
    MAX_TOKENS: [G(128, 256, 8, 3), G(128, 128, 4, 4), G(128, 128, 8, 4), G(64, 256, 4, 3), G(256, 128, 8, 3),
           G(128, 64, 4, 4), G(64, 128, 4, 4), G(128, 256, 8, 4), G(64, 128, 4, 3), G(256, 64, 8, 3)],
}

_DECODE_MOE = [T(16, 64, 128, 128, 4, 4), T(16, 32, 128, 128, 4, 4), T(16, 64, 64, 128, 4, 4),
               T(16, 32, 64, 128, 4, 5), T(16, 32, 64, 128, 4, 3), T(16, 64, 128, 128, 4, 5),
               T(16, 32, 64, 128, 8, 4), T(16, 128, 128, 128, 4, 4), T(16, 16, 64, 128, 4, 4),
               T(16, 32, 256, 128, 4, 4)]
MOE_GRID = {  # bucket bound -> candidates (block_m, block_n1, block_n2, block_k, num_warps, num_stages)
    16: _DECODE_MOE,
    64: _DECODE_MOE,
    256: [T(16, 64, 128, 128, 4, 4), T(32, 64, 128, 128, 4, 4), T(32, 32, 64, 128, 4, 4), T(16, 32, 128, 128, 4, 4),
          T(64, 64, 128, 128, 4, 4), T(16, 64, 64, 128, 4, 4), T(32, 64, 128, 128, 8, 4), T(16, 32, 64, 128, 4, 5),
          T(32, 128, 128, 128, 4, 3), T(16, 128, 128, 128, 4, 4)],
    MAX_TOKENS: [T(128, 64, 128, 64, 8, 3), T(128, 64, 128, 64, 4, 3), T(64, 64, 128, 64, 4, 4), T(128, 128, 128, 64, 8, 3),
           T(64, 128, 128, 64, 4, 3), T(128, 64, 256, 64, 8, 3), T(128, 64, 128, 64, 8, 4), T(64, 64, 64, 64, 4, 4),
           T(64, 128, 256, 64, 8, 3), T(128, 128, 256, 64, 8, 4)],
}


def _grid(grid: dict, m: int) -> list:
    return tile_row(tuple(grid.items()), m)[1]


def _ordered(current, cands, family: str, max_cfg: int) -> list:
    if family == "mxfp8":
        cands = [dataclasses.replace(c, num_stages=min(8, c.num_stages + 2)) for c in cands]
    out = [current]
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:max_cfg]


def gemm_candidates(m: int, family: str, current: G, max_cfg: int) -> list:
    """The current tile first, then the bucket's grid (module doc), at most max_cfg configs."""
    return _ordered(current, _grid(GEMM_GRID, m), family, max_cfg)


def moe_candidates(m: int, family: str, current: T, max_cfg: int) -> list:
    """The current tile (block_k as today's) first, then the bucket's grid, at most max_cfg configs."""
    return _ordered(current, [dataclasses.replace(c, block_k=current.block_k) for c in _grid(MOE_GRID, m)],
                    family, max_cfg)


def best_per_bucket(rows: list, table_name: str, tables: dict) -> dict:
    """{family: ((bound, config), ...)}: per bucket, the config with the least summed graph time over every
    (M, shape) cell of that bucket among configs measured "ok" in all of them; today's config where none is."""
    out = {}
    for family, table in tables.items():
        entries = []
        for bound, current in table:
            cells = {}
            for r in rows:
                if (r["table"] == table_name and r["family"] == family and r["status"] == "ok"
                        and tile_row(table, r["m"])[0] == bound and r["graph_us"] == r["graph_us"]):
                    cells.setdefault((r["m"], r["shape"]), {})[r["config_key"]] = (r["graph_us"], r["config_obj"])
            common = set.intersection(*(set(c) for c in cells.values())) if cells else set()
            scores = {key: sum(c[key][0] for c in cells.values()) for key in common}
            best = min(scores, key=scores.get) if scores else None
            entries.append((bound, next(iter(cells.values()))[best][1] if best else current))
        out[family] = tuple(entries)
    return out


def tiles_literal(name: str, cls: str, tables: dict) -> str:
    """Python source of a tile table (`NAME: dict[...] = {...}`) to paste over the one in the kernel module."""
    lines = [f"{name}: dict[str, tuple[tuple[int, {cls}], ...]] = {{"]
    for family, entries in tables.items():
        parts = [f"({'MAX_TOKENS' if bound == MAX_TOKENS else bound}, {cfg!r})" for bound, cfg in entries]
        lines.append(f'    "{family}": (' + (",\n" + " " * (len(family) + 9)).join(parts) + "),")
    return "\n".join(lines + ["}"])


def _metric(r) -> str:
    if r.get("%BW") is not None and r["m"] <= 256:
        return f"{r['%BW']:5.1f}%BW"
    return f"{r.get('TF/s') or float('nan'):5.0f}TF/s" if r["m"] > 256 else f"{r.get('TF/s') or float('nan'):5.1f}TF/s"


def _fmt_cfg(cfg) -> str:
    return "-" if cfg is None else "(" + ",".join(str(v) for v in dataclasses.astuple(cfg)) + ")"


def print_report(rows: list, bw: float, fl: float, skipped: int, stopped, literal: str) -> None:
    """Per (kernel, M, shape): the current tile's time, the best tile and its time, the speedup; then failures and
    the paste-ready tables."""
    print(f"\ncopy {bw:.0f} GB/s, bf16 GEMM {fl:.0f} TFLOP/s; {len(rows)} rows, {skipped} jobs skipped (budget)"
          + (f"; stopped: {stopped}" if stopped else ""))
    print(f"{'kernel':<19}{'M':>5} {'shape':<11}{'current us':>11}{'(cur)':>10}{'best us':>10}{'(best)':>10}"
          f"{'speedup':>8}  {'best config':<24}{'ok/tried':>8}")
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["kernel"], r["m"], r["shape"]), []).append(r)
    for (kernel, m, shape), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        ok = [r for r in rs if r["status"] == "ok"]
        timed = [r for r in ok if r["graph_us"] == r["graph_us"]]  # smoke: no times (NaN)
        cur = next((r for r in timed if r["is_current"]), None)
        best = min(timed, key=lambda r: r["graph_us"], default=None)
        cur_us = f"{cur['graph_us']:.1f}" if cur else "-"
        best_us = f"{best['graph_us']:.1f}" if best else "-"
        speed = f"{cur['graph_us'] / best['graph_us']:.2f}x" if cur and best else "-"
        print(f"{kernel:<19}{m:>5} {shape:<11}{cur_us:>11}{_metric(cur) if cur else '-':>10}{best_us:>10}"
              f"{_metric(best) if best else '-':>10}{speed:>8}  {_fmt_cfg(best['config_obj']) if best else '-':<24}"
              f"{len(ok):>4}/{len(rs):<3}")
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed[:12]:
        print(f"  {r['status']}: {r['kernel']} M={r['m']} {r['shape']} {_fmt_cfg(r['config_obj'])} "
              f"rel={r['rel_err']} {r.get('error', '')[:100]}")
    if len(failed) > 12:
        print(f"  ... {len(failed) - 12} more failures in the JSON")
    print("* speed reference only: row-wise scales, not ladle's block-scaled math (gpu_quant_suite's module doc)")
    print("\n# best tile per kernel family and M bucket (paste over the tables in ladle/kernels/fp8_gemm.py and "
          "ladle/kernels/fused_moe.py):\n" + literal, flush=True)


class Recorder:
    """Rows, the JSON file (rewritten after every row) and the final report (printed and written next to the JSON
    as .txt); safe to call from the watchdog."""

    def __init__(self, path, timer, args):
        self.path, self.timer, self.args, self.rows, self.lock = path, timer, args, [], threading.Lock()
        self.t0, self.skipped, self.stopped = time.monotonic(), 0, None

    def add(self, row):
        with self.lock:
            self.rows.append(row)
            self._write(finished=False)
        us, rel = row["graph_us"], row["rel_err"]
        print(f"ROW {row['kernel']} M={row['m']} {row['shape']} {row['config_key']} {row['status']} "
              f"rel={'-' if rel is None else f'{rel:.1e}'} {'-' if us is None else f'{us:.1f}'} us "
              f"{row.get('error', '')[:100]}", flush=True)

    def _write(self, finished):
        out = {"copy_GBps": self.timer.bw, "bf16_TFps": self.timer.fl, "smoke": self.args.smoke,
               "budget_s": self.args.time_budget_s, "elapsed_s": time.monotonic() - self.t0, "finished": finished,
               "skipped_jobs": self.skipped, "stopped": self.stopped, "tiles": literals(self.rows),
               "rows": [{k: v for k, v in r.items() if k != "config_obj"} for r in self.rows]}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def finish(self, finished):
        if not self.lock.acquire(timeout=10):
            print("(recorder busy; the table below may miss the last row)", flush=True)
        try:
            self._write(finished)
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                print_report(self.rows, self.timer.bw, self.timer.fl, self.skipped, self.stopped, literals(self.rows))
            with open(os.path.splitext(self.path)[0] + ".txt", "w") as f:
                f.write(text.getvalue())
            print(text.getvalue(), flush=True)
        finally:
            if self.lock.locked():
                self.lock.release()


def literals(rows) -> str:
    gemm = best_per_bucket(rows, "gemm", fp8_gemm.GEMM_TILES)
    moe = best_per_bucket(rows, "moe", fused_moe.MOE_TILES)
    return (tiles_literal("GEMM_TILES", "GemmTileConfig", gemm) + "\n\n"
            + tiles_literal("MOE_TILES", "MoETileConfig", moe))


def cuda_poisoned() -> bool:
    """True when the CUDA context is unusable (an illegal access is sticky: every later call would fail)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001
        return True
