import time, torch, logging, sys
logging.basicConfig(level=logging.INFO)
from ladle.engine.llm import LLM
from ladle.core.sampling_params import SamplingParams
d = ".gpu_smoke_runner/smol"
prompts = [[1 + (7 * i + j) % 1000 for j in range(20 + 13 * i)] for i in range(16)]
res = {}
for eager in (True, False):
    t = time.time()
    llm = LLM(d, load_format="dummy", device="cuda", enforce_eager=eager, max_model_len=2048, max_num_seqs=64)
    print("eager", eager, "load", time.time() - t, "blocks", llm.core.runner.num_blocks, "graphs", llm.core.runner.graphs is not None, flush=True)
    t = time.time()
    g = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2))
    s = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, n=2, max_tokens=64, ignore_eos=True, repetition_penalty=1.1))
    u = llm.generate(prompts[:4], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    print("gen", time.time() - t, llm.core.get_stats(), flush=True)
    res[eager] = ([o.outputs[0].token_ids for o in g], [[c.token_ids for c in o.outputs] for o in s])
    print(g[0].outputs[0].token_ids[:10], g[0].outputs[0].logprobs[0], flush=True)
    del llm; torch.cuda.empty_cache()
same_g = sum(a == b for a, b in zip(res[True][0], res[False][0]))
same_s = sum(a == b for a, b in zip(res[True][1], res[False][1]))
print("greedy equal eager vs graph:", same_g, "/", len(prompts), " seeded equal:", same_s, "/", len(prompts))
