"""The upstream HTTP/1.1 client, by its public names.

`Upstream` (client.py) sends one request within one deadline and says NotSent or
OutcomeLost; `Pool` and `Connection` (pool.py) keep connections alive and say which
may carry a request; `Exchange` (parser.py) parses one answer; `UpstreamResponse`,
`BodyStream` and `ResponseBudget` (response.py) are what a forward hands back.
"""

from gateway.upstream.client import Upstream
from gateway.upstream.parser import Exchange
from gateway.upstream.pool import Connection, Pool
from gateway.upstream.response import BodyStream, Broken, ResponseBudget, UpstreamResponse

__all__ = [
    "BodyStream",
    "Broken",
    "Connection",
    "Exchange",
    "Pool",
    "ResponseBudget",
    "Upstream",
    "UpstreamResponse",
]
