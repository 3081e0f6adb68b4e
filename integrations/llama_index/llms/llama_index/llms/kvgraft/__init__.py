"""LlamaIndex LLM (a FunctionCallingLLM) over a frozen Hugging Face model with exact KV grafting from
kvmemory, a response synthesizer that answers from retrieved kvmemory entries' grafted KV, and the
tokenizer hook that counts the model's own tokens."""

from llama_index.llms.kvgraft.base import OUTCOME_KEYS, REPORT_KEYS, KVGraft, KVGraftLLM, answer_kwargs, outcome_kwargs
from llama_index.llms.kvgraft.messages import to_kv_messages, to_message, tool_selections
from llama_index.llms.kvgraft.tokens import KVGraftTokenizer, kvgraft_tokenizer
from llama_index.llms.kvgraft.synthesizer import REPORT_METADATA_KEY, KVGraftSynthesizer

__all__ = ["KVGraftLLM", "KVGraft", "KVGraftSynthesizer", "KVGraftTokenizer", "kvgraft_tokenizer", "OUTCOME_KEYS", "REPORT_KEYS", "REPORT_METADATA_KEY",
           "answer_kwargs", "outcome_kwargs", "to_kv_messages", "to_message", "tool_selections"]
