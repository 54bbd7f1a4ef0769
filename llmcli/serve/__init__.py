"""`llmcli serve`: a trained run behind OpenAI's completions API (the optional extra
`llmcli[serve]`: FastAPI and uvicorn).

`protocol` (a request body checked into a `CompletionRequest`, or a `ChatRequest` for
`/v1/chat/completions`; responses and OpenAI's error JSON) -> `logprobs` (log-probs kept in step
with a choice's text) -> `batcher` (the generation thread:
requests that arrive together run as one padded batch through `llmcli.generation.batching`) ->
`app` (the FastAPI app: endpoints, streaming, API key, limits) -> `server` (load a run, listen).
"""
