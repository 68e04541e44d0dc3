"""The HTTP front end of a node: OpenAI's API, Prometheus metrics and a live dashboard.

``openai``: OpenAI request/response shapes (pure). ``metrics``: the node's Prometheus
registry. ``app``: the ASGI app (every completion goes through ``Node.submit``). ``server``:
runs it in the node's trio loop with hypercorn's trio worker.
"""

from peerinfer.http.server import (
    DEFAULT_HTTP,
    check_exposure,
    is_loopback,
    parse_http_address,
    serve_http,
)

__all__ = ["DEFAULT_HTTP", "check_exposure", "is_loopback", "parse_http_address", "serve_http"]
