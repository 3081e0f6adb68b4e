"""LangChain's published chat-model unit suite on ChatKVGraft (no model is loaded by these tests)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_kvmemory import ChatKVGraft

_ENV_STORE = str(Path(tempfile.gettempdir()) / "kvmemory-env-store-never-created")


class TestChatKVGraftUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVGraft]:
        return ChatKVGraft

    @property
    def chat_model_params(self) -> dict:
        return {"store": str(Path(tempfile.gettempdir()) / "kvmemory-unit-store-never-created")}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        # The store folder comes from $KVMEMORY_STORE when not given, as everywhere in kvmemory.
        return {"KVMEMORY_STORE": _ENV_STORE}, {}, {"store": _ENV_STORE}
