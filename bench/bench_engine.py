#!/usr/bin/env python
"""Engine core vs transformers (issue 2): one process, same weights, same machine.

Drives :class:`stages.engine.core.engine.LLMEngine` in-process (``add_request`` then ``step()`` in a
loop; no Ray, no threads) next to Hugging Face ``transformers`` ``generate`` on the same
SmolLM2-135M-Instruct float32 weights, and measures:

(a) batch-1 decode tokens/s: a ~32-token prompt, 128 greedy output tokens, EOS ignored.
    Decode tok/s = (tokens - 1) / (time of the last token - time of the first token), for both.
    Ours: the wall-clock time at which ``step()`` returned each token. transformers: a
    ``BaseStreamer`` whose ``put()`` stamps ``time.perf_counter()``; ``generate`` calls it once
    with the prompt and then once per new token, right after that token is chosen.
(b) 32 concurrent requests x 128 output tokens (prompts of 20-60 tokens, greedy, EOS ignored):
    total output tokens / wall time. Ours: all added at once, ``step()`` until done.
    transformers one-at-a-time: a subset of the requests is generated one after another and the
    mean per-request time is extrapolated to all 32. transformers static batch: one ``generate``
    over all 32 prompts, left padding, ``pad_token_id`` set.
(c) TTFT of a 1,000-token prompt whose first 900 tokens are in the prefix cache vs cold. Every
    repeat uses a fresh engine state (new scheduler and block manager over the same weights and
    KV tensors, so nothing is cached): cold = TTFT of prefix + suffix X; that request leaves the
    900-token prefix (56 full 16-token blocks = 896 tokens) in the cache; warm = TTFT of prefix +
    a different suffix Y. TTFT = ``add_request`` to the ``step()`` that returns the first token.
    Run with ``max_num_batched_tokens=1024`` (cold prefill in one step) and with the default 512.
(d) batch-1 decode step time per weight format (``--weights``, default float32,int4,int8; a
    format may name its matmul kernel, e.g. ``int4/torch``; the formats alternate within each repeat) next to the memory-bandwidth floor: copy bandwidth
    (512 MB float32 ``copy_``, best of several, read + write bytes counted) and read bandwidth
    (``sum`` over the same tensor); floor = the bytes that format actually reads per decode step
    (linear layers as their kernel reads them at one row, LM head, norms, one embedding row, and
    the K/V at the median context) / the higher of the two. Parts (a)-(c) use float32 weights.

Medians over repeats after warm-up runs; ours and transformers alternate within each repeat so
background load hits both alike. Writes ``bench/results/engine.json`` and ``engine.md``.

    .venv/bin/python bench/bench_engine.py            # full run (~5-8 min on 2 cores)
    .venv/bin/python bench/bench_engine.py --quick    # smoke check (~1 min)
    .venv/bin/python bench/bench_engine.py --parts a,d
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from stages.config import EngineSettings  # noqa: E402
from stages.engine.core.engine import LLMEngine  # noqa: E402
from stages.model_info import EMBEDDED_MODEL, load_tokenizer, model_info, resolve_model_dir  # noqa: E402
from stages.transport.messages import SamplingParams  # noqa: E402

GOALS = {"a": 1.0, "b_seq": 4.0, "b_static": 1.5, "c": 5.0}

# Plain English text the prompts are cut from (windows at different offsets -> distinct prompts).
TEXT = (
    "The history of computing is a story of layers. At the bottom, transistors switch on and off "
    "billions of times per second; above them, logic gates combine those switches into adders, "
    "multiplexers and memory cells. Engineers then group these into processors with caches, "
    "pipelines and branch predictors, and compilers translate human-readable programs into the "
    "instructions those processors understand. Operating systems share the machine among many "
    "programs, giving each the illusion of its own memory and its own processor. Networks connect "
    "machines across rooms, cities and oceans, and protocols agree on how bytes travel between "
    "them. Databases keep records safe when the power fails, and web servers answer millions of "
    "requests from people who never think about any of these layers. Today a new layer is being "
    "added: large language models that read text, predict the next word, and answer questions. "
    "Serving such a model efficiently is itself a systems problem. Each request arrives with a "
    "prompt of different length, asks for a different number of tokens, and expects the first "
    "word quickly. The server must batch requests together so that the expensive weights are read "
    "from memory once for many sequences, keep the attention keys and values of every sequence in "
    "a cache that grows token by token, and reuse the cached work when two prompts share a prefix. "
    "Scheduling decides which requests run in each step, how much of a long prompt is processed at "
    "once, and what to do when memory runs short. Good schedulers keep the hardware busy while "
    "keeping latency low for every user, a balance that is easy to describe and hard to achieve. "
    "Gardeners know a similar balance: plant too densely and nothing thrives, too sparsely and the "
    "weeds move in. Cooks, too, juggle many pans, starting the slow dishes first and finishing the "
    "quick ones at the last moment so everything reaches the table hot."
)


# -- helpers -----------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class CpuMonitor:
    """CPU time used by *other* processes while a part runs (machine busy time from /proc/stat
    minus this process's own CPU time), in cores: 0 means we had the machine to ourselves."""

    def __init__(self) -> None:
        self.t0 = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        busy = float("nan")
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
        except (OSError, ValueError):
            pass
        return time.perf_counter(), busy, time.process_time()

    def other_cores(self) -> float:
        wall0, busy0, own0 = self.t0
        wall1, busy1, own1 = self._sample()
        return round(max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9), 2)


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = float("nan")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = int(line.split()[1]) / (1 << 20)
                break
    except OSError:
        pass
    import transformers

    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu,
        "ram_gib": round(mem_gb, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "requested_threads": threads,
    }


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Bench:
    """Holds the engine's runner, the transformers model and the tokenizer for all parts."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.args = args
        t0 = time.perf_counter()
        # Parts (a)-(c) compare against transformers on the same float32 weights.
        base = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(num_threads=args.threads, weights="float32",
                                                                    device=args.device, dtype="float32"))
        self.runner = base.runner
        self.info = model_info(EMBEDDED_MODEL)
        self.tok = load_tokenizer(EMBEDDED_MODEL)
        model_dir = resolve_model_dir(EMBEDDED_MODEL)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(args.device)
        torch.set_num_threads(args.threads)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.info.eos_token_ids[0]
        self.text_ids: list[int] = self.tok(TEXT, add_special_tokens=False)["input_ids"]
        self.runners: dict[str, Any] = {}
        self.load_s = time.perf_counter() - t0

    # -- our engine -----------------------------------------------------------------------------
    def engine(self, max_num_batched_tokens: int = 512) -> LLMEngine:
        """A fresh engine state (empty queues, empty prefix cache) over the shared runner."""
        cfg = EngineSettings(num_threads=self.args.threads, device=self.args.device,
                             max_num_batched_tokens=max_num_batched_tokens, weights="float32")
        return LLMEngine(cfg, self.runner, self.info.eos_token_ids, self.info.vocab_size,
                         self.info.max_model_len)

    def runner_for(self, weights: str) -> Any:
        """The shared float32 runner, or one built (once) for another weight format: ``int4``,
        ``int8`` (the default matmul kernel), or ``int4/torch``, ``int8/native``... (that kernel)."""
        if weights == "float32":
            return self.runner
        if weights not in self.runners:
            fmt, _, kernel = weights.partition("/")
            eng = LLMEngine.from_config(EMBEDDED_MODEL, EngineSettings(
                num_threads=self.args.threads, weights=fmt, num_kv_blocks=self.runner.num_blocks,
                device=self.args.device, quant_kernel=kernel or "auto"))
            self.runners[weights] = eng.runner
        return self.runners[weights]

    def ours_single(self, prompt: list[int], n: int, weights: str = "float32") -> dict[str, Any]:
        """One request; returns first/last token times, per-step durations and tokens."""
        eng = self.engine()
        eng.runner = self.runner_for(weights)
        t_add = time.perf_counter()
        eng.add_request("r", prompt, greedy(n))
        tokens: list[int] = []
        stamps: list[float] = []
        step_s: list[float] = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            for o in outs:
                tokens.extend(o.new_token_ids)
                stamps.extend([t1] * len(o.new_token_ids))
        return {"tokens": tokens, "ttft": stamps[0] - t_add, "first": stamps[0], "last": stamps[-1],
                "decode_step_s": step_s[1:]}  # step 0 is the prefill that yields the first token

    def ours_batch(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        eng = self.engine()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, greedy(n))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        step_s: list[tuple[int, float]] = []
        while eng.has_unfinished():
            s0 = time.perf_counter()
            outs = eng.step()
            step_s.append((len(outs), time.perf_counter() - s0))
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
        wall = time.perf_counter() - t0
        full = [s for b, s in step_s if b == len(prompts)]
        return {"wall_s": wall, "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
                "num_steps": len(step_s), "median_full_batch_step_s": median(full)}

    def ours_ttft(self, eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int, int]:
        """(TTFT, cached tokens, steps) of a one-token request on ``eng``."""
        t0 = time.perf_counter()
        eng.add_request(rid, prompt, greedy(1))
        steps = 0
        while True:
            outs = eng.step()
            steps += 1
            mine = [o for o in outs if o.request_id == rid and o.new_token_ids]
            if mine:
                ttft = time.perf_counter() - t0
                while eng.has_unfinished():
                    eng.step()
                return ttft, mine[0].num_cached_tokens, steps

    # -- transformers ---------------------------------------------------------------------------
    def hf_single(self, prompt: list[int], n: int) -> dict[str, Any]:
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self) -> None:
                self.t: list[float] = []

            def put(self, value: Any) -> None:
                self.t.append(time.perf_counter())

            def end(self) -> None:
                pass

        st = Stamps()
        ids = torch.tensor([prompt], device=self.args.device)
        t_start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=self.pad_id,
                                   streamer=st)
        t_end = time.perf_counter()
        tok_t = st.t[1:]  # st.t[0] is the prompt
        return {"tokens": out[0, len(prompt):].tolist(), "ttft": tok_t[0] - t_start,
                "first": tok_t[0], "last": tok_t[-1], "wall_s": t_end - t_start}

    def hf_static(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        width = max(len(p) for p in prompts)
        dev = self.args.device
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=self.pad_id)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "tokens": out[:, width:].tolist()}

    # -- prompts --------------------------------------------------------------------------------
    def window(self, offset: int, length: int) -> list[int]:
        ids = self.text_ids
        return [ids[(offset + j) % len(ids)] for j in range(length)]


def match_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- parts ---------------------------------------------------------------------------------------
def part_a(b: Bench, n: int, repeats: int) -> dict[str, Any]:
    prompt = b.window(0, 32)
    print(f"[a] batch-1 decode: prompt {len(prompt)} tokens, {n} output tokens, {repeats} repeats",
          flush=True)
    b.ours_single(prompt, 8)  # warm-up
    b.hf_single(prompt, 8)
    ours, hf, step_s, ttft_o, ttft_h = [], [], [], [], []
    match = None
    for r in range(repeats):
        o = b.ours_single(prompt, n)
        h = b.hf_single(prompt, n)
        assert len(o["tokens"]) == n and len(h["tokens"]) == n, (len(o["tokens"]), len(h["tokens"]))
        ours.append((n - 1) / (o["last"] - o["first"]))
        hf.append((n - 1) / (h["last"] - h["first"]))
        ttft_o.append(o["ttft"])
        ttft_h.append(h["ttft"])
        step_s.extend(o["decode_step_s"])
        match = match_prefix(o["tokens"], h["tokens"])
        print(f"    repeat {r}: ours {ours[-1]:.1f} tok/s, transformers {hf[-1]:.1f} tok/s "
              f"(greedy tokens identical for the first {match}/{n})", flush=True)
    res = {
        "prompt_tokens": len(prompt), "output_tokens": n, "repeats": repeats,
        "ours_decode_tok_s": ours, "hf_decode_tok_s": hf,
        "ours_ttft_s": ttft_o, "hf_ttft_s": ttft_h,
        "median_ours_decode_tok_s": median(ours), "median_hf_decode_tok_s": median(hf),
        "ratio": median(ours) / median(hf), "goal": GOALS["a"],
        "greedy_match_tokens": match, "ours_decode_step_s": step_s,
        "median_ours_decode_step_s": median(step_s),
    }
    res["met"] = res["ratio"] >= GOALS["a"]
    return res


def part_b(b: Bench, num: int, n: int, repeats: int, subset: int) -> dict[str, Any]:
    rng = random.Random(1234)
    lens = [rng.randint(20, 60) for _ in range(num)]
    prompts = [b.window(17 * i, lens[i]) for i in range(num)]
    total = num * n
    print(f"[b] {num} requests x {n} tokens (prompts {min(lens)}-{max(lens)} tokens), "
          f"{repeats} repeat(s); transformers one-at-a-time timed on {subset} requests", flush=True)
    b.ours_batch(prompts[:4], 4)  # warm-up
    b.hf_static(prompts[:4], 4)
    ours, seq, static, step_med = [], [], [], []
    seq_per_req: list[float] = []
    match_seq: list[int] = []
    for r in range(repeats):
        o = b.ours_batch(prompts, n)
        ours.append(total / o["wall_s"])
        step_med.append(o["median_full_batch_step_s"])
        times = []
        for i in range(subset):
            h = b.hf_single(prompts[i], n)
            times.append(h["wall_s"])
            match_seq.append(match_prefix(o["tokens"][i], h["tokens"]))
        seq_per_req.extend(times)
        # Extrapolated: all requests take the median per-request time (robust to a stray slow one).
        seq.append(n / median(times))  # = num * n / (num * median per-request time)
        s = b.hf_static(prompts, n)
        static.append(total / s["wall_s"])
        print(f"    repeat {r}: ours {ours[-1]:.1f} tok/s ({o['wall_s']:.1f}s, {o['num_steps']} steps), "
              f"transformers one-at-a-time {seq[-1]:.1f} tok/s (extrapolated), "
              f"static batch {static[-1]:.1f} tok/s ({s['wall_s']:.1f}s)", flush=True)
    res = {
        "num_requests": num, "output_tokens": n, "prompt_lens": lens, "repeats": repeats,
        "hf_sequential_subset": subset, "hf_sequential_per_request_s": seq_per_req,
        "ours_tok_s": ours, "hf_sequential_tok_s": seq, "hf_static_tok_s": static,
        "median_ours_tok_s": median(ours), "median_hf_sequential_tok_s": median(seq),
        "median_hf_static_tok_s": median(static),
        "ours_median_full_batch_step_s": median(step_med),
        "greedy_match_tokens_vs_hf_single": match_seq,
    }
    res["ratio_vs_sequential"] = res["median_ours_tok_s"] / res["median_hf_sequential_tok_s"]
    res["ratio_vs_static"] = res["median_ours_tok_s"] / res["median_hf_static_tok_s"]
    res["goal_vs_sequential"], res["goal_vs_static"] = GOALS["b_seq"], GOALS["b_static"]
    res["met_vs_sequential"] = res["ratio_vs_sequential"] >= GOALS["b_seq"]
    res["met_vs_static"] = res["ratio_vs_static"] >= GOALS["b_static"]
    return res


def part_c(b: Bench, prompt_len: int, prefix_len: int, repeats: int,
           budgets: list[int]) -> dict[str, Any]:
    rng = random.Random(99)
    vocab = b.info.vocab_size
    # Random ordinary token ids: content does not change the cost of a forward pass.
    prefix = [rng.randrange(100, vocab - 100) for _ in range(prefix_len)]
    sx = [rng.randrange(100, vocab - 100) for _ in range(prompt_len - prefix_len)]
    sy = [rng.randrange(100, vocab - 100) for _ in range(prompt_len - prefix_len)]
    print(f"[c] TTFT of a {prompt_len}-token prompt, {prefix_len} tokens shared, {repeats} repeats, "
          f"max_num_batched_tokens in {budgets}", flush=True)
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "shared_prefix_tokens": prefix_len,
                           "repeats": repeats, "goal": GOALS["c"], "runs": {}}
    for mbt in budgets:
        # Warm-up (allocator, kernels at these shapes), not recorded.
        eng = b.engine(mbt)
        b.ours_ttft(eng, "w0", prefix + sx)
        b.ours_ttft(eng, "w1", prefix + sy)
        cold, warm, cached, steps = [], [], [], []
        for r in range(repeats):
            eng = b.engine(mbt)  # fresh state: nothing cached
            tc, c0, sc = b.ours_ttft(eng, "cold", prefix + sx)
            tw, cw, sw = b.ours_ttft(eng, "warm", prefix + sy)
            assert c0 == 0, c0
            cold.append(tc)
            warm.append(tw)
            cached.append(cw)
            steps.append((sc, sw))
            print(f"    mbt={mbt} repeat {r}: cold {tc * 1e3:.0f} ms ({sc} step(s)), "
                  f"warm {tw * 1e3:.0f} ms ({cw} cached tokens, {sw} step(s))", flush=True)
        run = {"cold_ttft_s": cold, "warm_ttft_s": warm, "cached_tokens": cached,
               "steps_cold_warm": steps, "median_cold_ttft_s": median(cold),
               "median_warm_ttft_s": median(warm)}
        run["speedup"] = run["median_cold_ttft_s"] / run["median_warm_ttft_s"]
        run["met"] = run["speedup"] >= GOALS["c"]
        out["runs"][str(mbt)] = run
    return out


def bandwidth(nbytes: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    """Best copy and read bandwidth of ``device``'s memory (on CUDA the GPU's, synchronised around
    each timing: the floor of a GPU step is its HBM, not the host's memory)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    copy_s, sum_s = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        copy_s.append(time.perf_counter() - t0)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        src.sum()
        sync()
        sum_s.append(time.perf_counter() - t0)
    del src, dst
    return {"tensor_bytes": nbytes, "repeats": repeats, "device": device,
            "copy_gb_s_read_plus_write": 2 * nbytes / min(copy_s) / 1e9,
            "read_gb_s_sum": nbytes / min(sum_s) / 1e9}


def step_bytes(runner: Any, context_len: int) -> dict[str, int]:
    """Bytes a batch-1 decode step reads: every linear layer's weights as its kernel reads them at
    one row (packed int4/int8 + bfloat16 scales, or float32), the LM head, the norms, one embedding
    row, and the K/V of ``context_len`` cached tokens in every layer."""
    from stages.engine.runner.quant import QuantLinear

    model = runner.model
    linear = head = other = 0
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            nbytes = mod.weight_bytes(rows=1) + (mod.bias.numel() * 4 if mod.bias is not None else 0)
            if name == "lm_head":
                head += nbytes
            else:
                linear += nbytes
        elif isinstance(mod, torch.nn.Linear):
            nbytes = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
            if name == "lm_head":
                head += nbytes
            else:
                linear += nbytes
    emb = model.embed_tokens.weight
    for pname, p in model.named_parameters():
        if ".norm" in pname or "layernorm" in pname or pname == "norm.weight":
            other += p.numel() * p.element_size()
    other += emb.shape[1] * emb.element_size()  # the one embedding row looked up
    kv = context_len * runner.kv_bytes_per_token
    return {"linear": linear, "lm_head": head, "norms_and_embedding_row": other, "kv": kv,
            "total": linear + head + other + kv}


def part_d(b: Bench, formats: list[str], n: int, repeats: int, bw_bytes: int, bw_repeats: int,
           hf_tok_s: float | None) -> dict[str, Any]:
    """Batch-1 decode step per weight format, measured alternately, next to the bandwidth floor of
    the bytes that format actually reads per step."""
    print(f"[d] batch-1 decode step vs bandwidth floor, per weight format {formats}", flush=True)
    bw = bandwidth(bw_bytes, bw_repeats, b.args.device)
    best = max(bw["copy_gb_s_read_plus_write"], bw["read_gb_s_sum"])
    prompt = b.window(0, 32)
    steps: dict[str, list[float]] = {f: [] for f in formats}
    tokens: dict[str, list[int]] = {}
    for f in formats:  # warm-up (and build the runner) outside the timing
        b.ours_single(prompt, 8, f)
    for r in range(repeats):
        for f in formats:
            run = b.ours_single(prompt, n, f)
            steps[f].extend(run["decode_step_s"])
            tokens[f] = run["tokens"]
        print(f"    repeat {r + 1}: " + ", ".join(f"{f} {median(steps[f]) * 1e3:.1f} ms" for f in formats),
              flush=True)
    ctx = len(prompt) + n // 2  # the median decode step's context
    res: dict[str, Any] = {**bw, "floor_bandwidth_gb_s": best, "output_tokens": n, "repeats": repeats,
                           "median_context_tokens": ctx, "formats": {}}
    ref = tokens.get("float32")
    for f in formats:
        nbytes = step_bytes(b.runner_for(f), ctx)
        floor = nbytes["total"] / (best * 1e9)
        step = median(steps[f])
        row = {"bytes_per_step": nbytes, "floor_step_s": floor, "median_decode_step_s": step,
               "steps_measured": len(steps[f]), "ratio_step_over_floor": step / floor,
               "decode_tok_s": 1.0 / step}
        if ref is not None:
            row["greedy_tokens_equal_to_float32"] = match_prefix(tokens[f], ref)
        res["formats"][f] = row
        print(f"    {f}: {nbytes['total'] / 1e6:.1f} MB/step -> floor {floor * 1e3:.2f} ms; median step "
              f"{step * 1e3:.2f} ms ({step / floor:.2f}x floor)", flush=True)
    if hf_tok_s:
        res["hf_time_per_decode_token_s"] = 1.0 / hf_tok_s
    return res


# -- report ------------------------------------------------------------------------------------------
def yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(res: dict[str, Any]) -> str:
    rows = ["| Measurement | Ours | transformers | Ratio | Goal | Met |",
            "|---|---|---|---|---|---|"]
    a, bb, c, d = (res["parts"].get(k) for k in "abcd")
    if a:
        rows.append(f"| (a) batch-1 decode, {a['prompt_tokens']}-tok prompt, {a['output_tokens']} tokens "
                    f"(median of {a['repeats']}) | {a['median_ours_decode_tok_s']:.1f} tok/s | "
                    f"{a['median_hf_decode_tok_s']:.1f} tok/s | {a['ratio']:.2f}x | ≥ {a['goal']:.1f}x | "
                    f"{yes(a['met'])} |")
    if bb:
        what = f"(b) {bb['num_requests']} requests x {bb['output_tokens']} tokens, total output tok/s"
        rows.append(f"| {what} vs one-at-a-time (timed {bb['hf_sequential_subset']}, extrapolated) | "
                    f"{bb['median_ours_tok_s']:.1f} tok/s | {bb['median_hf_sequential_tok_s']:.1f} tok/s | "
                    f"{bb['ratio_vs_sequential']:.2f}x | ≥ {bb['goal_vs_sequential']:.1f}x | "
                    f"{yes(bb['met_vs_sequential'])} |")
        rows.append(f"| {what} vs static batched generate (batch {bb['num_requests']}, left padding) | "
                    f"{bb['median_ours_tok_s']:.1f} tok/s | {bb['median_hf_static_tok_s']:.1f} tok/s | "
                    f"{bb['ratio_vs_static']:.2f}x | ≥ {bb['goal_vs_static']:.1f}x | "
                    f"{yes(bb['met_vs_static'])} |")
    if c:
        for mbt, run in c["runs"].items():
            cached = run["cached_tokens"][0] if run["cached_tokens"] else 0
            rows.append(f"| (c) TTFT, {c['prompt_tokens']}-tok prompt, {cached} cached vs cold, "
                        f"max_num_batched_tokens={mbt} (median of {c['repeats']}) | "
                        f"warm {run['median_warm_ttft_s'] * 1e3:.0f} ms | "
                        f"(ours cold) {run['median_cold_ttft_s'] * 1e3:.0f} ms | "
                        f"{run['speedup']:.1f}x faster | ≥ {c['goal']:.0f}x | {yes(run['met'])} |")
    if d:
        for f, row in d["formats"].items():
            nb = row["bytes_per_step"]
            hf = (f"{d['hf_time_per_decode_token_s'] * 1e3:.1f} ms/token (float32)"
                  if f == "float32" and "hf_time_per_decode_token_s" in d else "—")
            rows.append(f"| (d) batch-1 decode step, **{f}** weights, vs bandwidth floor "
                        f"({nb['total'] / 1e6:.1f} MB read per step / {d['floor_bandwidth_gb_s']:.1f} GB/s = "
                        f"{row['floor_step_s'] * 1e3:.2f} ms) | {row['median_decode_step_s'] * 1e3:.1f} ms/step "
                        f"| {hf} | {row['ratio_step_over_floor']:.2f}x floor | — | — |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke check)")
    ap.add_argument("--parts", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--device", default="cpu", help="engine and transformers device (cpu or cuda)")
    ap.add_argument("--weights", default="float32,int4,int8",
                    help="weight formats for (d), measured alternately (default float32,int4,int8)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats for (a) and (c) (default 3)")
    ap.add_argument("--b-repeats", type=int, default=None, help="repeats for (b) (default 2)")
    ap.add_argument("--hf-subset", type=int, default=None,
                    help="requests timed for transformers one-at-a-time in (b) (default 4)")
    ap.add_argument("--wait-load", type=float, default=0.0,
                    help="before starting, wait until the 1-minute load average is at most this "
                         "(0: don't wait); other work on the machine distorts every number")
    ap.add_argument("--wait-max", type=float, default=600.0,
                    help="give up waiting for --wait-load after this many seconds (default 600)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "engine.json"),
                    help="JSON output (a .md table is written beside it)")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    bad = parts - set("abcd")
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    q = args.quick
    n_a = 32 if q else 128
    rep = args.repeats or (1 if q else 3)
    b_num, b_n = (8, 32) if q else (32, 128)
    b_rep = args.b_repeats or (1 if q else 2)
    subset = args.hf_subset or (2 if q else 4)
    c_len, c_prefix = (400, 360) if q else (1000, 900)
    torch.set_num_threads(args.threads)

    if args.wait_load > 0:
        deadline = time.time() + args.wait_max
        while loadavg() and loadavg()[0] > args.wait_load and time.time() < deadline:
            time.sleep(5)
    started = time.time()
    load_start = loadavg()
    print(f"load average at start: {load_start}", flush=True)
    b = Bench(args)
    print(f"loaded engine + transformers in {b.load_s:.1f}s; torch threads {torch.get_num_threads()}",
          flush=True)
    res: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "bench/bench_engine.py", *sys.argv[1:]]),
        "quick": q, "machine": machine_info(args.threads), "model": EMBEDDED_MODEL,
        "dtype": "float32", "load_average_start": load_start, "load_average_by_part": {},
        "other_processes_cpu_cores_by_part": {}, "parts": {},
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
    }
    if "a" in parts:
        res["load_average_by_part"]["a"] = loadavg()
        mon = CpuMonitor()
        res["parts"]["a"] = part_a(b, n_a, rep)
        res["other_processes_cpu_cores_by_part"]["a"] = mon.other_cores()
    if "b" in parts:
        res["load_average_by_part"]["b"] = loadavg()
        mon = CpuMonitor()
        res["parts"]["b"] = part_b(b, b_num, b_n, b_rep, subset)
        res["other_processes_cpu_cores_by_part"]["b"] = mon.other_cores()
    if "c" in parts:
        res["load_average_by_part"]["c"] = loadavg()
        mon = CpuMonitor()
        res["parts"]["c"] = part_c(b, c_len, c_prefix, rep, [1024, 512])
        res["other_processes_cpu_cores_by_part"]["c"] = mon.other_cores()
    if "d" in parts:
        res["load_average_by_part"]["d"] = loadavg()
        mon = CpuMonitor()
        a = res["parts"].get("a")
        hf_tok_s = a["median_hf_decode_tok_s"] if a else None
        formats = [f.strip() for f in args.weights.split(",") if f.strip()]
        res["parts"]["d"] = part_d(b, formats, n_a, rep, 512 << 20, 3 if q else 7, hf_tok_s)
        res["other_processes_cpu_cores_by_part"]["d"] = mon.other_cores()
        if a:  # keep the JSON small
            a.pop("ours_decode_step_s", None)
    res["load_average_end"] = loadavg()
    res["elapsed_s"] = time.time() - started
    table = markdown(res)
    if q:
        table += "\n_--quick: smaller workloads than the goals are stated for; a smoke check only._\n"
    res["markdown_table"] = table

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"Command: `{res['command']}`\n\n"
        f"Load average start {res['load_average_start']}, end {res['load_average_end']}; "
        f"CPU used by other processes during each part (cores of {res['machine']['nproc']}): "
        f"{res['other_processes_cpu_cores_by_part']}; {res['elapsed_s']:.0f}s\n\n" + table)
    print()
    print(table)
    print(f"other processes' CPU use by part (cores): {res['other_processes_cpu_cores_by_part']}")
    print(f"load average: start {load_start}, end {res['load_average_end']}; "
          f"elapsed {res['elapsed_s']:.0f}s; wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
