"""LlamaIndex LLM over a frozen Hugging Face model with exact KV grafting from kvmemory, and a
response synthesizer that answers from retrieved kvmemory entries' grafted KV."""

from llama_index.llms.kvgraft.base import REPORT_KEYS, KVGraft, KVGraftLLM, answer_kwargs, to_kv_messages
from llama_index.llms.kvgraft.synthesizer import REPORT_METADATA_KEY, KVGraftSynthesizer

__all__ = ["KVGraftLLM", "KVGraft", "KVGraftSynthesizer", "REPORT_KEYS", "REPORT_METADATA_KEY", "answer_kwargs",
           "to_kv_messages"]
