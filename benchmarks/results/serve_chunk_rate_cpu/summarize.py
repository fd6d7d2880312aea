"""Medians per (load, step, N, tree) of the JSONs beside this file (serve_chunk_rate.py runs; see README.md)."""
import collections
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
rows = collections.defaultdict(list)
for pat, tag in ((HERE + "/final_*_*.json", "rounds1"), (HERE + "/arr_*_*.json", "rounds3")):
    for f in sorted(glob.glob(pat)):
        v = f.split("/")[-1].split("_")[1]
        for r in json.load(open(f))["rows"]:
            rows[(tag, r["step_ms"], r["concurrency"], v)].append(r)
print(f"{'load':<8}{'step':>5}{'N':>5}{'tree':>6}{'runs':>5}{'chunks/s':>10}{'tok/chunk':>10}{'ITL ms':>8}{'srv us/chunk':>13}{'loop us':>9}{'gc us':>7}  all chunks/s")
for key in sorted(rows, key=lambda k: (k[0], -k[1], k[2], ["base", "new", "std"].index(k[3]))):
    rs = rows[key]
    med = lambda f: statistics.median(r[f] for r in rs)
    print(f"{key[0]:<8}{key[1]:>5}{key[2]:>5}{key[3]:>6}{len(rs):>5}{med('chunks_per_s'):>10.0f}{med('tokens_per_chunk'):>10.2f}{med('median_itl_ms'):>8.2f}{med('server_us_per_chunk'):>13.1f}{med('loop_us_per_chunk'):>9.1f}{med('gc_us_per_chunk'):>7.1f}  {[round(r['chunks_per_s']) for r in rs]}")
