"""Token counts through a model's own tokenizer, without loading the model.

Frameworks count tokens to trim a conversation to a budget (LangChain's `get_num_tokens*` and
`trim_messages`, LlamaIndex's tokenizer hook). Loading an engine for that would read the weights
(seconds, a gigabyte); the tokenizer alone is read from the same local folder the loader reads
(`kvmemory.models.loading.resolve_model_path`, which converts the embedded model once) in a fraction
of a second, never from the network, and is kept per model for the life of the process.

Counts are the model's own: a text is encoded as the engine encodes text (`Engine.encode`: no special
tokens added), a conversation is rendered as the model reads it (`render_ids` with the chat template,
the tools' and the response schema's instructions in the system turn as `chat.run_chat` puts them,
and the assistant turn opened), so `count_chat_tokens` equals the prompt tokens of a call that routes
nothing. Wherever a loaded engine is at hand, pass its tokenizer instead of a model name: every
function takes either.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmemory.adapters.messages import schema_prompt, tools_prompt, with_instructions
from kvmemory.errors import InvalidInput
from kvmemory.memory.prompts import encode, render_ids
from kvmemory.models.loading import DEFAULT_MODEL, resolve_model_path

__all__ = ["tokenizer_for", "encode_text", "count_tokens", "chat_token_ids", "count_chat_tokens"]

_lock = threading.Lock()
_tokenizers: dict[str, Any] = {}  # model name as given -> tokenizer (and resolved folder -> tokenizer)

Tokenizer = Any  # a transformers tokenizer (PreTrainedTokenizerBase), or anything with its interface
ModelOrTokenizer = str | None | Tokenizer


def tokenizer_for(model: ModelOrTokenizer = None) -> Tokenizer:
    """The tokenizer of `model` (an HF id, a local folder, or None / the embedded default), read from
    local files only and cached per model; a tokenizer object is returned as it is. A model that is
    not here raises the loader's UnknownModel; a folder without a readable tokenizer InvalidInput."""
    if model is not None and not isinstance(model, str):
        if not callable(getattr(model, "apply_chat_template", None)) and not callable(model):
            raise InvalidInput(f"model must be a model name or a tokenizer, got {type(model).__name__}")
        return model
    name = model or DEFAULT_MODEL
    with _lock:  # one load per model even when a framework's thread pool asks at once
        tok = _tokenizers.get(name)
        if tok is None:
            path = resolve_model_path(name)
            tok = _tokenizers.get(path) or _load(name, path)
            _tokenizers[name] = _tokenizers[path] = tok
        return tok


def _load(name: str, path: str) -> Tokenizer:
    # `local_files_only`: an id not in the local hub cache fails at once, instead of retrying the hub
    # offline for half a minute; kvmemory downloads nothing at run time.
    local = Path(path).expanduser()
    try:
        generic = _generic_class(local)
        if generic is not None:
            return generic.from_pretrained(str(local), local_files_only=True)
        from kvmemory.models import lean_tokenizer

        return lean_tokenizer.load(str(local) if local.is_dir() else path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"no tokenizer for model {name!r} in the local files ({exc.__class__.__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); give a local model folder, "
                           "or an HF id already in the hub cache") from exc


def _generic_class(folder: Path) -> Any:
    """transformers' generic tokenizers-backed class when the folder's tokenizer_config names it (the
    embedded model's does), else None (AutoTokenizer then picks the class). Loading it directly gives
    the class AutoTokenizer gives, without AutoTokenizer reading the model's config, which imports the
    model's modeling code: seconds, on a cold process, for nothing a tokenizer needs."""
    try:
        cls_name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if cls_name != "TokenizersBackend":
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers without it: AutoTokenizer
        return None
    return TokenizersBackend


def encode_text(model: ModelOrTokenizer, text: str) -> list[int]:
    """The token ids of `text` as the engine encodes text (no special tokens added)."""
    if not isinstance(text, str):
        raise InvalidInput(f"text must be a string, got {type(text).__name__}")
    return encode(tokenizer_for(model), text) if text else []


def count_tokens(model: ModelOrTokenizer, text: str) -> int:
    """How many tokens `text` is for the model."""
    return len(encode_text(model, text))


def chat_token_ids(model: ModelOrTokenizer, turns: Sequence[dict[str, str]], *, tools: Sequence[dict] = (),
                   response_schema: dict | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a conversation as the model reads it: `turns` ({"role", "content"}, from
    `messages.to_turns`) with the tools' / the schema's instructions in the system turn, rendered by the
    chat template, the assistant turn opened when `add_generation_prompt` (what a chat call decodes from
    when it routes nothing). `tools`: OpenAI tool dicts, as bound (a call with tool_choice "none" reads
    none: pass none)."""
    if isinstance(turns, (str, bytes)) or not all(isinstance(t, dict) for t in turns):
        raise InvalidInput("turns must be a list of {'role': ..., 'content': ...} dicts")
    full = with_instructions(turns, tools_prompt(tools) if tools else "",
                             schema_prompt(response_schema) if response_schema is not None else "")
    if not full:
        return []
    return render_ids(tokenizer_for(model), full, add_generation_prompt=add_generation_prompt)


def count_chat_tokens(model: ModelOrTokenizer, turns: Sequence[dict[str, str]], *, tools: Sequence[dict] = (),
                      response_schema: dict | None = None, add_generation_prompt: bool = True) -> int:
    """How many tokens the model reads for a conversation (see `chat_token_ids`)."""
    return len(chat_token_ids(model, turns, tools=tools, response_schema=response_schema,
                              add_generation_prompt=add_generation_prompt))
