"""LangChain's published chat-model integration suite on ChatKVGraft over the embedded SmolLM2-135M.

Declared through the suite's properties: text-only input (no image / audio / PDF / video); JSON mode
is supported (schema-guided); usage metadata reports grafted prompt tokens as `cache_read`; the
model override is a real second model (a random-init Llama saved to a local folder).
`tool_policy="user_turn"` is the documented setting for a model this small: an unforced call that
answers a user message is a tool call, one after a tool result is text (see ChatKVGraft.tool_policy).
"""

from __future__ import annotations

from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_kvmemory import ChatKVGraft
from lc_testutil import PROBLEMS, seeded_store, tiny_model_path


class TestChatKVGraftStandard(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVGraft]:
        return ChatKVGraft

    @property
    def chat_model_params(self) -> dict:
        return {"store": seeded_store(), "max_tokens": 10, "tool_policy": "user_turn"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return tiny_model_path()

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        # A rewording of a stored problem routes to its entry, whose stored KV is grafted.
        llm = ChatKVGraft(**self.chat_model_params)
        question = PROBLEMS[1].rewordings[0]
        if not stream:
            return llm.invoke(question)
        full = None
        for chunk in llm.stream(question):
            full = chunk if full is None else full + chunk
        return full
