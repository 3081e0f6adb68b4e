"""What every framework adapter shares, written once (the LangChain and LlamaIndex integrations are thin
layers over these):

- `shared`: one `KVMemory` per (model, store) in a process, and the lock its callers hold;
- `messages`: framework messages as chat-template turns, the tool-call text protocol, the system turn's
  instructions (tools, a JSON schema);
- `guided`: decoding passes over one prompt: free text, choices scored by the model, schema-guided JSON
  and forced tool calls;
- `chat`: one chat call with routing, prefix caching, tools and structured output, and what it cost;
- `after_tool`: what a call after a tool result does (answer, stating the result, unless another call
  is clearly likelier; never a repeated call), so agent loops end;
- `streaming`: a decode in a worker thread, its visible text delivered to a sync or async consumer,
  stopped (and the lock released) when the consumer goes away;
- `tokens`: token counts through the model's own tokenizer (text, and conversations as the model reads them),
  without loading the model;
- `options`: checks of a call's options (max_tokens, prompt text, sampling), the same on every integration;
- `errors`: the adapters' typed errors.
"""
