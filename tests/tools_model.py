"""A tiny random-weight Qwen2-architecture model whose chat template supports tools (Hermes style).

No small tool-calling model ships in a PyPI package, so the tool-call tests make one: SmolLM2's
tokenizer (its ``<|im_start|>`` chat markers are Hermes'), two layers of 64 random weights, and a
chat template written here that renders ``tools`` and earlier ``tool_calls`` the way Hermes and
Qwen2.5 models are trained to read them. Its output is noise unless a grammar forces a call, which
is exactly what the tests need: the ``<tool_call>`` parser sees only what the grammar made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from stages.model_info import resolve_model_dir

#: Written for these tests (not copied from any model's template).
TOOLS_TEMPLATE = """\
{%- set ns = namespace(system="You are a helpful assistant.") -%}
{%- if messages and messages[0].role == "system" -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
<|im_start|>system
{{ ns.system }}
{%- if tools %}{{ "\n\n" }}Functions you may call, one JSON signature per line:
<tools>
{% for tool in tools %}{{ tool | tojson }}{{ "\n" }}{% endfor %}</tools>
To call one, answer with its name and arguments as one JSON object inside tags, one block per call:
<tool_call>
{"name": "<name>", "arguments": {<arguments>}}
</tool_call>
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == "system" and loop.first -%}
{%- elif message.role == "assistant" -%}
<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def build_tools_model(target: Path, seed: int = 0) -> Path:
    """Write the model directory at ``target`` (idempotent) and return it."""
    import torch
    from safetensors.torch import save_file

    done = target / ".complete"
    if done.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    source = Path(resolve_model_dir("embedded:smollm2-135m-instruct"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    vocab, hidden, layers, heads, kv_heads, inter = 49152, 64, 2, 4, 2, 128
    head_dim = hidden // heads
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "torch_dtype": "float32"}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    (target / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    state = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                  p + "self_attn.q_proj.bias": rand(heads * head_dim),
                  p + "self_attn.k_proj.bias": rand(kv_heads * head_dim),
                  p + "self_attn.v_proj.bias": rand(kv_heads * head_dim),
                  p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                  p + "mlp.down_proj.weight": rand(hidden, inter),
                  p + "input_layernorm.weight": torch.ones(hidden),
                  p + "post_attention_layernorm.weight": torch.ones(hidden)}
    save_file(state, str(target / "model.safetensors"))
    done.touch()
    return target
