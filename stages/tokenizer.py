"""A light tokenizer for the CPU stages: the Rust ``tokenizers`` library plus the model's Jinja chat template.

Preprocess and Egress need a tokenizer and a chat template, nothing else from transformers; importing
transformers for them pulls in torch and costs a CPU-stage replica about 340 MB and ten seconds of
start-up (``bench/experiments/bench_cpu_replica.py``). :class:`Tokenizer` reads the same files transformers
reads from a Hugging Face model directory and reproduces what the CPU stages use of transformers'
``TokenizersBackend`` (transformers 5):

* ``tokenizer.json`` through ``tokenizers.Tokenizer``; the named and extra special tokens of
  ``tokenizer_config.json`` that it lacks are added as special tokens; its post-processor decides
  BOS/EOS (transformers 5 ignores ``add_bos_token``/``add_eos_token`` when ``tokenizer.json`` exists);
* the chat template from ``chat_template.jinja`` (plus ``additional_chat_templates/*.jinja``), else
  ``tokenizer_config.json``'s ``chat_template``; rendered in jinja2's immutable sandbox with
  ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` tag, and the globals
  and filters transformers gives templates (``raise_exception``, ``tojson`` without HTML escaping,
  ``strftime_now``, a restricted ``dict`` and ``namespace``), with the named special tokens
  (``bos_token``, ``eos_token``, ...) as variables;
* ``decode`` with transformers' ``clean_up_tokenization_spaces`` rule (never applied to BPE).

The method names and signatures are transformers' own (``encode``, ``decode``, ``__call__``,
``convert_ids_to_tokens``, ``apply_chat_template(..., tokenize=False)``, ``backend_tokenizer``),
so code and tests written against a transformers tokenizer take either. transformers stays the
reference: ``tests/unit/test_tokenizer.py`` checks ids, rendered prompts and decodes against it.
Verified for the generic ``tokenizer_class`` values (``TokenizersBackend``, ``PreTrainedTokenizerFast``);
a model-specific class whose ``__init__`` rebuilds the backend in Python (transformers 5 does that
for e.g. ``LlamaTokenizer``, ``Qwen2Tokenizer``) is logged as unverified: run the parity test on
that model before trusting it. Slow-only tokenizers are out of scope: a directory without ``tokenizer.json`` raises
``FileNotFoundError``, and :func:`stages.model_info.load_cpu_tokenizer` then falls back to transformers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.processors import TemplateProcessing

from stages.token_floor import TokenFloor

logger = logging.getLogger(__name__)

#: transformers' named special tokens, in its order (``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: tokenizer classes whose transformers behaviour is tokenizer.json's (the parity test covers them).
_GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


#: Texts at least this long are encoded through the GIL-releasing batch call (same ids).
GIL_FREE_ENCODE_CHARS = 2048


def _content(token: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) transformers would load from ``model_dir`` (files win over the config)."""
    templates: dict[str, str] = {}
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in value}
    return value if isinstance(value, (str, dict)) else None


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (anything else becomes an inert placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalise_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """transformers' message preparation: dicts only, ``None`` values dropped, reasoning aliased."""
    out = []
    for message in messages:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@lru_cache(maxsize=8)
def compile_chat_template(template: str) -> Any:
    """Compile ``template`` in the same sandboxed environment transformers uses (cached per string)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; render its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` without attribute access to the real type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's Namespace signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def _no_word_cache(backend: RustTokenizer) -> None:
    """Turn off a BPE model's word cache (``tokenizers`` keeps 10,000 pre-tokenised words).

    The rule: CPU-stage replicas must return to their floor after any request, and this cache
    stops them. Its entries are allocated among a long prompt's encoding temporaries, so after a
    1 MB prompt they pin ~40 MB of heap pages that ``malloc_trim`` cannot return, for the replica's
    life. It buys no speed we can measure here: byte-level BPE words are short, and encoding 2k to
    28k tokens of prose took the same time with and without it (BENCHMARKS.md, issue 33's third
    round). Models without the hook (another model type, an older ``tokenizers``) keep theirs."""
    resize = getattr(backend.model, "_resize_cache", None)
    if resize is not None:
        resize(0)


class Tokenizer:
    """Encode, decode and chat-template one model with ``tokenizers`` and jinja2 only (no transformers)."""

    def __init__(self, backend: RustTokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 extra_special_tokens: Iterable[str] = (), chat_template: str | dict[str, str] | None = None,
                 clean_up_tokenization_spaces: bool = False, name_or_path: str = "") -> None:
        self._tokenizer = backend
        self.special_tokens_map: dict[str, str] = dict(special_tokens or {})
        self.extra_special_tokens: list[str] = list(extra_special_tokens)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.name_or_path = name_or_path
        self._special_ids = frozenset(i for i in (backend.token_to_id(t) for t in self.all_special_tokens)
                                      if i is not None)
        self._floor = TokenFloor.of(backend)

    def min_tokens(self, text: str) -> int:
        """A floor on ``len(encode(text))`` that costs no encoding (0 where none is exact:
        :class:`TokenFloor`)."""
        return self._floor(text) if self._floor is not None else 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (``tokenizer.json`` required)."""
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} is missing (the light tokenizer needs a fast tokenizer file)")
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        backend = RustTokenizer.from_file(str(tokenizer_file))
        if config.get("tokenizer_class") not in _GENERIC_CLASSES:
            logger.warning("tokenizer_class %s of %s is model-specific; the light tokenizer follows tokenizer.json, "
                           "which transformers may not (check with tests/unit/test_tokenizer.py)",
                           config.get("tokenizer_class"), path)

        named = {name: tok for name in SPECIAL_TOKEN_NAMES if (tok := _content(config.get(name))) is not None}
        extra_cfg = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extra: list[str] = []
        if isinstance(extra_cfg, Mapping):  # model-specific named tokens (e.g. image_token) join the named map
            named.update({k: t for k, v in extra_cfg.items() if (t := _content(v)) is not None})
        else:
            extra = [t for v in extra_cfg if (t := _content(v)) is not None]
        # transformers adds every named/extra special token the backend does not already hold as an added token.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = list(dict.fromkeys(t for t in [*named.values(), *extra] if t not in added))
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists (its
        # post-processor decides), and only installs a plain one where the file has none.
        if backend.post_processor is None:
            backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        _no_word_cache(backend)
        return cls(backend, special_tokens=named, extra_special_tokens=extra,
                   chat_template=_read_chat_template(path, config),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                   name_or_path=str(path))

    # -- special tokens -------------------------------------------------------------------------
    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    # -- vocabulary -----------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> RustTokenizer:
        """The raw ``tokenizers.Tokenizer`` (what :mod:`stages.egress.detokenizer` streams with)."""
        return self._tokenizer

    def __len__(self) -> int:
        """Vocabulary size with the added tokens (transformers' ``len(tokenizer)``)."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=False))

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids
                if not (skip_special_tokens and int(i) in self._special_ids)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    # -- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < GIL_FREE_ENCODE_CHARS:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        # The batch call releases the GIL while it works (``encode`` holds it throughout), so a long
        # text encoded in a worker thread does not stall the event loop's thread; no offsets needed.
        batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``tokenizer(text)["input_ids"]``, as with transformers (one text, no tensors)."""
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text: str = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self._tokenizer.model).__name__ != "BPE":  # transformers never cleans up BPE output
            text = (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
                    .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
                    .replace(" 've", "'ve").replace(" 're", "'re"))
        return text

    # -- chat template --------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None) -> str:
        """The template string to render: ``chat_template`` (a string or a template name) or the model's."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if "default" not in own:
                    raise ValueError(f"this model has several chat templates and no default: {sorted(own)}")
                return own["default"]
        if chat_template is not None:
            return chat_template
        if not own:
            raise ValueError("this tokenizer has no chat template")
        return str(own)

    def apply_chat_template(self, conversation: list[Any], *, add_generation_prompt: bool = False,
                            tokenize: bool = False, chat_template: str | None = None,
                            tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render ``conversation`` with the model's template (transformers' defaults, except that
        ``tokenize`` defaults to ``False``: the stages render text, then encode it themselves).

        With ``tokenize=True`` the ids of the rendered text, without adding special tokens again.
        """
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = compile_chat_template(self.get_chat_template(chat_template))
        variables = {**self.special_tokens_map, **kwargs}
        text: str = template.render(messages=_normalise_messages(conversation), tools=_plain(tools),
                                    documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                    **_plain(variables))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={len(self)}, template={self.chat_template is not None})"

