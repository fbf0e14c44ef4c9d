"""`pp-runtime serve`: an OpenAI-compatible HTTP server over the online engine.

| module | what |
| --- | --- |
| `server.py` | `serve(cfg, ...)`: uvicorn, the workers started behind it, clean shutdown |
| `app.py` | the FastAPI routes, streaming (SSE), aborts on disconnect, 429 / 503 |
| `protocol.py` | OpenAI request bodies checked field by field; response and chunk bodies |
| `text.py` | the checkpoint's tokenizer, or token ids as text |
| `metrics.py` | `/metrics`: the runtime's live series (the Ray metrics' names) and the server's |
"""
