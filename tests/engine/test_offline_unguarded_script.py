"""A script file with no `if __name__ == "__main__":` guard that runs the offline LLM in-process with tensor
parallelism on CPU: the spawned ranks must not re-run the script (runner.worker.main_module_left_alone; they used to
import it as their `__main__`, start ranks of their own and die with multiprocessing's "bootstrapping phase"
RuntimeError), and dropping the LLM stops its ranks. Ctrl-C (SIGINT to the whole process group) in the middle of a
generate interrupts the call and leaves the ranks serving the next one (they used to die with KeyboardInterrupt)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

ENGINE = "load_format='dummy', max_model_len=512, kv_cache_memory_bytes=4 << 20, seed=3"


def test_unguarded_script_with_tensor_parallel_ranks(tiny_m3_dir, tmp_path):
    script = textwrap.dedent(f"""
        import gc, sys
        import psutil
        from ladle import LLM, SamplingParams
        print("script body ran", file=sys.stderr, flush=True)
        llm = LLM({tiny_m3_dir!r}, engine_core_process=False, tensor_parallel_size=2, {ENGINE})
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        ranks = [p for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        del llm
        gc.collect()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, alive
        print("ok")
    """)
    path = tmp_path / "unguarded_tp.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert done.stderr.count("script body ran") == 1, done.stderr[-3000:]


@pytest.mark.parametrize("in_own_process", [False, True], ids=["in-process", "core-process"])
def test_ctrl_c_to_the_process_group_leaves_the_ranks_serving(tiny_m3_dir, tmp_path, in_own_process):
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        from ladle import LLM, SamplingParams
        llm = LLM({tiny_m3_dir!r}, engine_core_process={in_own_process}, tensor_parallel_size=2, {ENGINE})
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        want = llm.generate([[5, 6, 7]], short)[0].outputs[0].token_ids
        threading.Timer(1.0, os.killpg, (os.getpgid(0), signal.SIGINT)).start()  # what Ctrl-C in a terminal does
        try:
            llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            raise SystemExit("not interrupted")
        except KeyboardInterrupt:
            pass
        for _ in range(2):
            assert llm.generate([[5, 6, 7]], short)[0].outputs[0].token_ids == want
        print("ok")
    """)
    path = tmp_path / "ctrl_c.py"
    path.write_text(script)
    # its own session: the SIGINT reaches the script's process group (it, its core process and its ranks) only
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                          start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
