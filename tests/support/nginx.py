"""A stock nginx of the test's own, in front of a service: the server block's
`location`s are the test's, everything else is nginx's defaults (it decodes the path,
resolves `.` and `..` and merges `//` before it picks a location, as every nginx does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.servers import Process, for_this_test, free_port
from tests.support.sso_proxy import nginx_binary


@contextmanager
def nginx_front(tmp: Path, locations: str) -> Iterator[Process]:
    """nginx on a free loopback port, serving `locations` (nginx config text); its
    access log is `<home>/access.log`, one request line as received each."""
    port = free_port()
    home = tmp / f"nginx-{port}"
    home.mkdir()
    conf = f"""
daemon off;
worker_processes 1;
pid {home}/nginx.pid;
error_log {home}/error.log;
events {{ worker_connections 1024; }}
http {{
  log_format line '$request $status';
  access_log {home}/access.log line;
  client_body_temp_path {home}/body;
  proxy_temp_path {home}/proxy;
  fastcgi_temp_path {home}/fastcgi;
  uwsgi_temp_path {home}/uwsgi;
  scgi_temp_path {home}/scgi;
  server {{
    listen 127.0.0.1:{port};
{locations}
  }}
}}
"""
    (home / "nginx.conf").write_text(conf)
    args = ["-p", str(home), "-e", str(home / "error.log"), "-c", str(home / "nginx.conf")]
    nginx = for_this_test(Process([nginx_binary(), *args], port, "nginx"))
    nginx.start()
    try:
        yield nginx
    finally:
        nginx.stop()


def access_lines(nginx: Process) -> list[str]:
    """What nginx logged: `GET /jobs/../status HTTP/1.1 404`, one line a request."""
    home = Path(nginx.args[2])
    log = home / "access.log"
    return log.read_text().splitlines() if log.exists() else []
