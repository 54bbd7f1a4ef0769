"""`llmcli serve`: a trained run behind OpenAI's completions API (the optional extra
`llmcli[serve]`: FastAPI and uvicorn).

`response` (OpenAI's response JSON: completions, choices, stream chunks, usage, and the error
JSON of an `APIError`) -> `request` (a request body checked into a `CompletionRequest`, or a
`ChatRequest` for `/v1/chat/completions`) -> `logprobs` (log-probs kept in step with a choice's
text) -> `batcher` (the generation thread: requests that arrive together run as one padded batch
through `llmcli.generation.batching`) -> `answer` (the batcher's events answered as one JSON body
or as server-sent events; a client gone cancels its request) -> `encoding` (a request's prompts,
or its conversation through the chat template, as token ids) -> `app` (the FastAPI app:
endpoints, API key, limits, errors) -> `server` (load a run, listen).
"""
