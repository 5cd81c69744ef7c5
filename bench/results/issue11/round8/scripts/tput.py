import sys, os, time, statistics, json
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
tok = load_tokenizer(EMBEDDED_MODEL)
T = ["rivers","volcanoes","bridges","bees","libraries","glaciers","trains","forests"]
def prompt(i, r):
    m=[{"role":"user","content":f"Write a detailed essay about {T[i%8]} number {i} (round {r}):"}]
    return tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, num_threads=1))
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
def run(n, r):
    for i in range(n): eng.add_request(f"{r}-{i}", prompt(i, r), sp)
    t0 = time.perf_counter(); first = None; steps = []
    while eng.has_unfinished():
        s0 = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - s0)
        if first is None: first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return {"tok_s": n * 128 / wall, "first_step_ms": first * 1e3, "decode_step_ms_p50": statistics.median(steps[1:]) * 1e3}
run(4, -1)
NS = [int(x) for x in os.environ.get("NS", "1,32").split(",")]
out = {n: run(n, 0) for n in NS}
print(json.dumps(out))
