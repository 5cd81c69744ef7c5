"""The CPU stages' light tokenizer (:mod:`stages.tokenizer`) against transformers, the reference.

Three models, no network: the embedded SmolLM2 (byte-level BPE, ChatML template with a default
system prompt), and two tiny tokenizers written to a temporary directory by transformers itself:

* ``wordlevel``: BOS added by ``tokenizer.json``'s own post-processor, template writes ``bos_token``
  and calls ``raise_exception``;
* ``bpe``: a byte-level BPE trained here, ``add_bos_token``/``add_eos_token`` in
  ``tokenizer_config.json`` but no post-processor in ``tokenizer.json``, special tokens that only
  ``tokenizer_config.json`` names (pad and two extras), and a
  template exercising what real templates use: whitespace control via ``trim_blocks`` /
  ``lstrip_blocks``, ``namespace``, ``loop.first``/``loop.last``, ``break``/``continue``,
  ``tojson`` (no HTML escaping), ``{% generation %}``, ``eos_token``, ``raise_exception``, ``tools``.

Each must give the same rendered prompts (several message shapes, with and without the generation
prompt), token ids (with and without special tokens), decodes, token strings, sizes and special ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.model_info import (
    EMBEDDED_MODEL,
    load_cpu_tokenizer,
    load_tokenizer,
    model_info,
    resolve_model_dir,
)
from stages.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", "system", ":", "hi", "there"]
WORD_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ m['role'] }} : {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)

# Indented and with block tags on their own lines: trim_blocks/lstrip_blocks decide every newline.
BPE_TEMPLATE = """{%- set ns = namespace(system='', turns=0) -%}
{% if messages[0]['role'] == 'system' %}
    {% set ns.system = messages[0]['content'] %}
{% endif %}
<|sys|>{{ ns.system if ns.system else 'Default <system> & "prompt"' }}
{% if tools %}
    tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['role'] == 'tool' %}
        {{ raise_exception('no tools here') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <|turn|>{{ message['role'] }} {{ ns.turns }}{{ ' first' if loop.first }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {% else %}
        {{ message['content'] }} {{ message | tojson }}
    {% endif %}
    {% if message.get('stop_here') %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|turn|>assistant
{% endif %}"""

CORPUS = ["hello world, how are you today?", "The quick brown fox jumps over the lazy dog.",
          "naïve café — déjà vu 😀 日本語 テキスト", "assistant user system tools turn <tag> & \"quotes\"",
          "def f(x):\n    return x * 2  # code\n\ttabs"] * 20


def _wordlevel_dir(path: Path) -> Path:
    from tokenizers import Tokenizer as Rust
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Rust(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = WORD_TEMPLATE
    tok.save_pretrained(path)
    return path


def _bpe_dir(path: Path) -> Path:
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Rust(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    # <|turn|> and <|sys|> exist only in tokenizer_config.json (extra special tokens): both loaders
    # must add them; <|pad|> likewise as the named pad token.
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>",
                                  unk_token="<|endoftext|>", pad_token="<|pad|>",
                                  extra_special_tokens=["<|turn|>", "<|sys|>"])
    tok.chat_template = BPE_TEMPLATE
    tok.save_pretrained(path)
    # Traps: add_bos_token/add_eos_token in the config (transformers 5 ignores them when tokenizer.json
    # exists) and a tokenizer.json without a post-processor (both loaders install a plain one).
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "add_bos_token": True,
                                       "add_eos_token": True}))
    # save_pretrained wrote the config-only special tokens into tokenizer.json too; take them out
    # again so that both loaders have to add them (in the same order, hence with the same ids).
    tokenizer_file = path / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    config_only = {"<|pad|>", "<|turn|>", "<|sys|>"}
    assert config_only <= {t["content"] for t in data["added_tokens"]}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in config_only]
    tokenizer_file.write_text(json.dumps({**data, "post_processor": None}))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"smollm2": Path(resolve_model_dir(EMBEDDED_MODEL)),
            "wordlevel": _wordlevel_dir(tmp_path_factory.mktemp("wordlevel")),
            "bpe": _bpe_dir(tmp_path_factory.mktemp("bpe"))}


@pytest.fixture(scope="module", params=["smollm2", "wordlevel", "bpe"])
def pair(request: pytest.FixtureRequest, dirs: dict[str, Path]) -> tuple[str, Any, Tokenizer]:
    from transformers import AutoTokenizer

    path = dirs[request.param]
    return request.param, AutoTokenizer.from_pretrained(path), Tokenizer.from_dir(path)


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "Be <kind> & \"exact\"."}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "  hi there  "}, {"role": "user", "content": "naïve 😀 日本語\n\ttabs"}],
    [{"role": "user", "content": "hello", "name": None}, {"role": "assistant", "content": "world"},
     {"role": "user", "content": "<|im_start|>user inject <|eos|> <s>", "stop_here": True},
     {"role": "user", "content": "never rendered by the bpe template"}],
    [{"role": "assistant", "content": "an assistant first"}],
]

TEXTS = ["hello world", " leading space", "hello  world\n\n trailing ", "naïve café — déjà vu 😀 日本語",
         "<|im_start|>user\nhi<|im_end|>", "<s> hello </s> there <unk>", "<|bos|>x<|eos|><|turn|>y", "", "\t\n"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_rendered_prompt_and_ids_match(pair: tuple[str, Any, Tokenizer], conv: int,
                                       add_generation_prompt: bool) -> None:
    name, ref, light = pair
    messages = CONVERSATIONS[conv]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = light.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert got == expected, name
    assert light.encode(got, add_special_tokens=False) == ref.encode(expected, add_special_tokens=False)
    assert light.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt) == \
        ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                return_dict=False)
    assert messages == CONVERSATIONS[conv], "rendering must not modify the caller's messages"


def test_tools_render_like_transformers(dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"here\"",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = CONVERSATIONS[1]
    ref, light = AutoTokenizer.from_pretrained(dirs["bpe"]), Tokenizer.from_dir(dirs["bpe"])
    expected = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert light.apply_chat_template(messages, tools=tools, add_generation_prompt=True) == expected
    assert '"Weather <now> & \\"here\\""' in expected  # tojson did not HTML-escape


def test_template_errors_match(pair: tuple[str, Any, Tokenizer]) -> None:
    import jinja2

    name, ref, light = pair
    if name == "smollm2":
        pytest.skip("the embedded template accepts every role")
    messages = [{"role": "user", "content": "hello"}, {"role": "tool", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as got:
        light.apply_chat_template(messages, tokenize=False)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches(pair: tuple[str, Any, Tokenizer], add_special_tokens: bool) -> None:
    name, ref, light = pair
    for text in TEXTS:
        expected = ref(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert light(text, add_special_tokens=add_special_tokens)["input_ids"] == expected, (name, text)
        assert light.encode(text, add_special_tokens=add_special_tokens) == expected, (name, text)


def test_decode_and_token_strings_match(pair: tuple[str, Any, Tokenizer]) -> None:
    import random

    name, ref, light = pair
    rng = random.Random(0)
    sequences = [ref.encode(t, add_special_tokens=True) for t in TEXTS]
    sequences += [[rng.randrange(len(ref)) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in sequences:
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), \
                (name, ids, skip)
        assert light.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), (name, ids)
        assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            ref.convert_ids_to_tokens(ids, skip_special_tokens=True), (name, ids)
    for token_id in range(len(ref)):  # what LogprobFormatter shows per token
        assert light.decode([token_id]) == ref.decode([token_id]), (name, token_id)


def test_vocabulary_and_special_tokens_match(pair: tuple[str, Any, Tokenizer]) -> None:
    name, ref, light = pair
    assert len(light) == len(ref), name
    assert light.vocab_size == ref.vocab_size
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert set(light.all_special_ids) == set(ref.all_special_ids)
    assert light.special_tokens_map == ref.special_tokens_map
    assert light.chat_template == ref.chat_template
    assert light.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str(), "same backend after loading"


def test_streaming_detokenizer_takes_the_light_tokenizer(pair: tuple[str, Any, Tokenizer]) -> None:
    from stages.egress.detokenizer import IncrementalDetokenizer, _backend

    name, ref, light = pair
    assert _backend(light) is light.backend_tokenizer
    ids = ref.encode("hello world naïve 😀 日本語 there", add_special_tokens=False)
    detok = IncrementalDetokenizer(light, [], skip_special_tokens=True)
    text = "".join(detok.add([i]).text for i in ids) + detok.finish()
    assert text == ref.decode(ids, skip_special_tokens=True), name


def test_model_info_reads_json_like_transformers_did() -> None:
    """model_info's JSON reading gives what the AutoConfig/GenerationConfig version gave."""
    from transformers import AutoConfig, GenerationConfig

    model_dir = resolve_model_dir(EMBEDDED_MODEL)
    config, gen, ref = AutoConfig.from_pretrained(model_dir), GenerationConfig.from_pretrained(model_dir), \
        load_tokenizer(EMBEDDED_MODEL)
    info = model_info(EMBEDDED_MODEL)
    eos = {config.eos_token_id, gen.eos_token_id, ref.eos_token_id} - {None}
    assert info.architecture == config.architectures[0]
    assert info.max_model_len == config.max_position_embeddings
    assert info.eos_token_ids == sorted(eos)
    assert info.bos_token_id == config.bos_token_id
    assert info.vocab_size == config.vocab_size
    assert info.chat_template == ref.chat_template
    assert isinstance(load_cpu_tokenizer(EMBEDDED_MODEL), Tokenizer)


def test_cpu_stages_never_import_transformers() -> None:
    """A Preprocess or Egress replica's whole start-up path, in a fresh interpreter."""
    code = (
        "import sys\n"
        "from stages.preprocess.preprocessor import Preprocessor\n"
        "from stages.egress.egress import Egress\n"
        "from stages.model_info import EMBEDDED_MODEL, load_cpu_tokenizer, model_info\n"
        "p = Preprocessor(EMBEDDED_MODEL)\n"
        "p.tokenize(prompt=None, messages=[{'role': 'user', 'content': 'hi'}], add_generation_prompt=True,"
        " add_special_tokens=False)\n"
        "Egress(load_cpu_tokenizer(EMBEDDED_MODEL), None)\n"
        "model_info(EMBEDDED_MODEL)\n"
        # Structured outputs compile in Preprocess too (llguidance has no torch underneath).
        "from stages.preprocess.grammar import GrammarCompiler\n"
        "from stages.transport.messages import StructuredOutputSpec\n"
        "GrammarCompiler(p.tokenizer, p.model_vocab_size, p.eos_token_ids).compile_sync("
        "StructuredOutputSpec('json_object', ''))\n"
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n"
    )
    assert _fresh_python(code).strip().splitlines()[-1] == "[]"


def _fresh_python(code: str) -> str:
    """``code``'s output, run in a fresh interpreter from the repository root (it must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_long_prompt_leaves_no_memory_pinned_after_a_trim() -> None:
    """A Preprocess replica's heap goes back to its floor after a 1 MB prompt (encoded on a worker
    thread, as the replica does): with ``tokenizers``' word cache on, ~40 MB stayed pinned."""
    code = (
        "import concurrent.futures, random, string\n"
        "from stages.heap import rss_bytes, trim_now\n"
        "from stages.preprocess.preprocessor import Preprocessor\n"
        "from stages.model_info import EMBEDDED_MODEL\n"
        "p = Preprocessor(EMBEDDED_MODEL)\n"
        "rng = random.Random(0)\n"
        "text = ' '.join(''.join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(2, 10)))"
        " for _ in range(180000))[:2**20]\n"
        "trim_now(); before = rss_bytes()\n"
        "with concurrent.futures.ThreadPoolExecutor(1) as pool:\n"
        "    n = pool.submit(lambda: len(p.encode(text, add_special_tokens=False))).result()\n"
        "trim_now(); print(n, (rss_bytes() - before) / 2**20)\n"
    )
    tokens, grown_mb = _fresh_python(code).split()
    assert int(tokens) > 500_000
    assert float(grown_mb) < 12, f"{grown_mb} MB still held after the prompt and a trim"


_TEXTS = ["", "a", "#" * 80, "#" * 81, "#" * 500, "\n" + " " * 80, "héllo wörld 你好 🙂", "<|im_start|>" * 5,
          "hello world " * 50, "".join(chr(c) for c in range(32, 2000))]


def test_the_token_floor_never_exceeds_the_encoding(pair: tuple[str, Any, Tokenizer]) -> None:
    """``min_tokens`` is a floor for every text, including runs of the longest tokens, multi-byte
    characters and special tokens; a byte-level BPE has one (the word-level model has none: 0)."""
    name, _, ours = pair
    floors = [ours.min_tokens(t) for t in _TEXTS]
    for text, floor in zip(_TEXTS, floors, strict=True):
        assert floor <= len(ours.encode(text, add_special_tokens=False)), (name, text[:40], floor)
    ours.min_tokens("a\ud800b")  # a lone surrogate (valid JSON) is the encoder's error to report, not the floor's
    if name == "wordlevel":
        assert not any(floors)
    else:
        assert floors[_TEXTS.index("#" * 500)] >= 2, floors


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_the_embedded_models_token_floor_holds_for_any_text(text: str) -> None:
    ours = _smol()
    assert ours.min_tokens(text) <= len(ours.encode(text, add_special_tokens=False))


@lru_cache(maxsize=1)
def _smol() -> Tokenizer:
    return load_cpu_tokenizer(EMBEDDED_MODEL)
