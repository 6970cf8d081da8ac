"""Whether the Hugging Face Hub answers from this machine: one bounded connection, never a retry.

A Kernel Hub load asks the Hub before it loads anything (kernels checks each repository's publisher unless
``HF_HUB_OFFLINE`` is set or ``LOCAL_KERNELS`` serves it), and a dataset name is read from the Hub; where the
Hub cannot be reached, both fail after retries with words that do not say so (kernels 0.19: "could not verify
publisher trust status. Set trust_remote_code=True"). This is the probe both ask first.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from urllib.parse import urlparse

__all__ = ["OFFLINE_VARIABLES", "hub_endpoint", "offline_setting", "unreachable_hub"]

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_ON = ("1", "true", "yes", "on")  # huggingface_hub's reading of a boolean variable


def hub_endpoint(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("HF_ENDPOINT") or "https://huggingface.co"


def offline_setting(names: tuple[str, ...] = OFFLINE_VARIABLES, environ: Mapping[str, str] | None = None
                    ) -> str | None:
    """``NAME=value`` of the first of ``names`` set on (the Hub is not asked), or None."""
    env = os.environ if environ is None else environ
    return next((f"{name}={env[name]}" for name in names if env.get(name, "").strip().lower() in _ON), None)


def unreachable_hub(timeout_s: float = 2.0, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the Hub (``HF_ENDPOINT``, else huggingface.co) cannot be reached from here, as the end of a sentence
    ("huggingface.co does not resolve"), or None when a connection to it opens within ``timeout_s``. Name
    resolution and the connection both run in a thread waited for at most ``timeout_s``: a resolver that hangs
    costs no more than one that fails."""
    url = urlparse(hub_endpoint(environ))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
        except OSError:
            outcome.append(f"{host} does not resolve")
            return
        try:
            socket.create_connection(address[:2], timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}:{port} does not answer ({type(exc).__name__}: {exc.strerror or exc})")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else f"{host}:{port} does not answer within {timeout_s:g} s"
