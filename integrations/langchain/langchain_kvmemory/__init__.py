"""langchain-kvmemory: kvmemory for LangChain and LangGraph.

- `ChatKVGraft`: a chat model over a frozen HF model that grafts stored KV (routed verified solutions,
  stored prompt prefixes), with tool calling, streaming and structured output.
- `KVMemoryRetriever`: verified solutions as Documents with their provenance.
- `KVMemoryStore`: a LangGraph `BaseStore` whose items are kvmemory entries.
- `create_remember_tool` / `create_recall_tool`: tools that let an agent store and look up verified solutions.
"""

from .chat_models import ChatKVGraft
from .retrievers import KVMemoryRetriever
from .stores import KVMemoryByteStore, KVMemoryStore
from .tools import create_recall_tool, create_remember_tool

__version__ = "0.1.0"

__all__ = ["ChatKVGraft", "KVMemoryRetriever", "KVMemoryStore", "KVMemoryByteStore", "create_recall_tool",
           "create_remember_tool", "__version__"]
