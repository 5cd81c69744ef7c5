import sys, time, statistics, torch
import os; sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]
tok = load_tokenizer(EMBEDDED_MODEL)
def prompt(i, r):
    msgs=[{"role":"user","content":f"Write a detailed essay about {TOPICS[i % 8]} number {i} (round {r}):"}]
    return tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
extra = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
cfg = EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, num_threads=int(extra.pop("threads", 1)), **{k:(int(v) if v.isdigit() else v) for k,v in extra.items()})
eng = LLMEngine.from_config(cfg)
print("prompt len", len(prompt(0,0)), "runner", eng.runner.model.dense_min_rows if hasattr(eng.runner.model,'dense_min_rows') else '-')
sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
eng.add_request("w", prompt(0,-1), sp)
while eng.has_unfinished(): eng.step()
res=[]
for r in range(6):
    for i in range(32): eng.add_request(f"r{r}-{i}", prompt(i, r), sp)
    t0=time.perf_counter(); eng.step(); t1=time.perf_counter()
    res.append((t1-t0)*1e3)
    while eng.has_unfinished(): eng.step()
print("32-prompt step ms", [round(x) for x in res], "median", round(statistics.median(res)))
if "--prof" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    for i in range(32): eng.add_request(f"p-{i}", prompt(i, 99), sp)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
