"""Starting `llmcli serve`: load the run, bind the address, run the app under uvicorn."""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmcli.device import resolve_device
from llmcli.errors import InputError
from llmcli.runs.loading import load_run
from llmcli.serve.app import ServeSettings, create_app

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def is_local(host: str) -> bool:
    """Whether `host` is reachable only from this machine (a loopback address)."""
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (port 0: a free one).

    Raises:
        InputError: the address is taken, not this machine's, or not allowed.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError(f"--host {host!r} is not an address of this machine ({exc}).") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = "choose another --port" if exc.errno == errno.EADDRINUSE else "check --host"
        raise InputError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; {hint}."
        ) from None
    return sock


def serve(
    checkpoint: str | Path | None,
    settings: ServeSettings,
    *,
    weights: str = "best",
    device: str = "auto",
    notify: Callable[[str], Any] = print,
) -> None:
    """Serve a run until interrupted: what `llmcli serve` does.

    Args:
        checkpoint: a run directory; None = the latest run under `checkpoints/`.
        settings: address, API key, limits, batching.
        weights, device: see `llmcli.runs.loading.load_run` and `llmcli.device.resolve_device`.
        notify: receives one-line notices (the run, the address, a warning for an open bind).
    """
    import uvicorn

    run = load_run(
        checkpoint, weights=weights, device=resolve_device(device, what="--device"), notify=notify
    )
    run.config.sample.keep_for(run.model.context_length)
    if not is_local(settings.host) and not settings.api_key:
        notify(
            f"warning: serving on {settings.host}, reachable from other machines, without an API "
            "key: anyone who can reach it can use it. Pass --api-key (or set LLMCLI_API_KEY), or "
            "bind to 127.0.0.1."
        )
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    app = create_app(run, settings)
    notify(f"serving {run.run_dir} at http://{_url_host(host)}:{port}/v1 (Ctrl-C stops)")
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
