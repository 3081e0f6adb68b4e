"""`kvmemory serve`: one model and one verified memory for many agents, over HTTP and MCP.

The layer above `adapters` / `bench` and below `cli`: it may use the memory facade and the adapters,
nothing below imports it, and `import kvmemory` never imports it (FastAPI, uvicorn and the MCP SDK are
the `serve` extra). Small modules, one job each:

- `config`: the server's settings and limits (`ServerConfig`);
- `worker`: the one compute worker and its bounded queue (the engine is not re-entrant);
- `auth`: API keys, tenants and the scope (`user_id` / `agent_id` / `run_id`) -> namespace mapping;
- `metrics`: Prometheus counters, gauges and histograms, rendered as text;
- `logs`: structured (JSON) logs;
- `errors`: HTTP errors as OpenAI-style JSON bodies;
- `openai_schema`: OpenAI requests as adapter calls, adapter outcomes as OpenAI responses;
- `completions`: the raw-text completion the `/v1/completions` route runs;
- `openai_routes`: `/v1/chat/completions`, `/v1/completions`, `/v1/models`;
- `memory_routes`: the memory API (`/v1/memory/...`);
- `mcp_tools`: the MCP server (remember, recall, answer, forget as tools; stdio and streamable HTTP);
- `app`: the FastAPI application (middleware, lifespan, `/healthz`, `/metrics`);
- `serve`: load the memory once and run uvicorn.
"""
