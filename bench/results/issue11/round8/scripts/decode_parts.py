import sys, os, time, statistics, torch, collections
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
from stages.engine import quant
import stages.engine.models.llama as L
tok = load_tokenizer(EMBEDDED_MODEL)
T = ["rivers","volcanoes","bridges","bees","libraries","glaciers","trains","forests"]
def prompt(i):
    m=[{"role":"user","content":f"Write a detailed essay about {T[i%8]} number {i} (round 0):"}]
    return tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, num_threads=1))
acc = collections.defaultdict(float)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t0; return r
    setattr(obj, name, g)
orig_qm = quant.QuantLinear.quant_matmul
def qm(self, x):
    t0=time.perf_counter(); r=orig_qm(self, x); acc["lm_head" if self.out_features > 10000 else "linears"] += time.perf_counter()-t0; return r
quant.QuantLinear.quant_matmul = qm
for cls, key in [(L.RMSNorm, "rmsnorm"), (L.Attention, "attention(all)"), (L.MLP, "mlp(all)")]:
    o = cls.forward
    def mk(o, key):
        def f(self, *a, **k):
            t0=time.perf_counter(); r=o(self,*a,**k); acc[key]+=time.perf_counter()-t0; return r
        return f
    cls.forward = mk(o, key)
o_dec = L.Attention._decode
def dec(self, *a, **k):
    t0=time.perf_counter(); r=o_dec(self,*a,**k); acc["attn_decode_kernel"]+=time.perf_counter()-t0; return r
L.Attention._decode = dec
r = eng.runner
wrap(r, "execute", "execute")
wrap(r, "prepare", "prepare")
wrap(r.model, "forward", "model.forward")
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for i in range(32): eng.add_request(f"r{i}", prompt(i), sp)
for s in range(20): eng.step()
acc.clear(); n=40; t0=time.perf_counter()
for s in range(n): eng.step()
wall=(time.perf_counter()-t0)/n
print(f"step {wall*1e3:.1f} ms")
for k,v in sorted(acc.items(), key=lambda kv:-kv[1]): print(f"  {k:22s} {v/n*1e3:7.2f} ms")
