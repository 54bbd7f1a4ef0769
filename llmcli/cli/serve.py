"""`llmcli serve`: a run behind OpenAI's completions API (the optional extra `llmcli[serve]`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmcli.cli.app import app, notify
from llmcli.cli.options import CheckpointOption, DeviceOption, WeightsOption
from llmcli.errors import InputError


@app.command("serve")
def serve_command(
    checkpoint: CheckpointOption = None,
    host: Annotated[
        str,
        typer.Option(help="Address to listen on; 0.0.0.0 is every interface (use --api-key)."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one).")] = 8000,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            help="Require 'Authorization: Bearer KEY' on every request.",
            envvar="LLMCLI_API_KEY",
            show_envvar=True,
            metavar="KEY",
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(help="Most new tokens a request may ask per choice.", metavar="N")
    ] = 1024,
    max_batch: Annotated[
        int,
        typer.Option(
            help="Most rows (prompts x n) generated as one batch, and per request.", metavar="N"
        ),
    ] = 64,
    batch_wait_ms: Annotated[
        float,
        typer.Option(help="How long a lone request waits for others to batch with.", metavar="MS"),
    ] = 5.0,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
) -> None:
    """Serve a run over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions for a chat
    run, /v1/models)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise InputError(
            f"llmcli serve needs FastAPI and uvicorn ({exc.name} is not installed): "
            "pip install 'llmcli[serve]'"
        ) from None
    from llmcli.serve.app import ServeSettings
    from llmcli.serve.request import Limits
    from llmcli.serve.server import serve

    if not 0 <= port <= 65535:
        raise InputError(f"--port ({port}) must be in 0..65535.")
    if batch_wait_ms < 0:
        raise InputError(f"--batch-wait-ms ({batch_wait_ms}) must be >= 0.")
    for name, value in (("--max-tokens", max_tokens), ("--max-batch", max_batch)):
        if value < 1:
            raise InputError(f"{name} ({value}) must be >= 1.")
    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key or None,
        limits=Limits(max_tokens=max_tokens, max_rows=max_batch),
        batch_wait_ms=batch_wait_ms,
    )
    serve(checkpoint, settings, weights=weights, device=device, notify=notify)
