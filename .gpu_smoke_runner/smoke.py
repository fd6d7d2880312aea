import time, torch, sys
from ladle.engine.llm import LLM
from ladle.core.sampling_params import SamplingParams
from ladle.observe import dispatch
d = ".gpu_smoke_runner/smol"
prompts = [[1 + (7 * i + j) % 1000 for j in range(20 + 13 * i)] for i in range(16)]
llm = LLM(d, load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=64, gpu_memory_utilization=0.5)
print("blocks", llm.core.runner.num_blocks, "graphs", llm.core.runner.graphs is not None, flush=True)
p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, n=2, max_tokens=32, ignore_eos=True, repetition_penalty=1.1, logprobs=3)
a = llm.generate(prompts, p); b = llm.generate(prompts, p)
print("seeded repeat:", [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b])
print("n children differ:", sum(o.outputs[0].token_ids != o.outputs[1].token_ids for o in a), "/ 16")
u = llm.generate(prompts[:4], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, min_p=0.05))
print(u[0].outputs[0].token_ids, a[0].outputs[0].logprobs[0])
t = time.time(); g = llm.generate([[1]*512]*32, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)); dt = time.time() - t
print(f"batch 32 x 512/256 greedy: {32*256/dt:.0f} output tok/s", flush=True)
print({k: v for k, v in dispatch.snapshot().items() if "sample" in str(k) or "graph" in str(k)} if hasattr(dispatch, "snapshot") else "")
