"""The documented single-sign-on setup, for real: nginx running the `location /` block
of docs/operator-api.md verbatim (its `auth_request` asks tests/support/sso_app.py, a
stand-in for oauth2-proxy, who the browser's `sso_user` cookie names), in front of a
gateway's admin listener that trusts nginx's address. The block is read from that page,
so the docs cannot drift from what works.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.servers import ROOT, Process, free_port


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not path:
        raise RuntimeError("no nginx: run scripts/setup, which installs it")
    return path


SSO_PAGE = ROOT / "docs" / "operator-api.md"


def documented_location() -> str:
    """The docs' nginx block (the `location /` in front of the admin listener)."""
    found = re.search(r"```nginx\n(.*?)```", SSO_PAGE.read_text(), re.S)
    assert found, f"{SSO_PAGE.relative_to(ROOT)} has no nginx block"
    return found.group(1)


@dataclass
class SsoFront:
    nginx: Process
    sso: Process

    @property
    def url(self) -> str:
        """The console's address as people reach it: nginx's."""
        return self.nginx.url

    @property
    def other_site(self) -> str:
        """Another origin of the same site (another port of this host): the sso app."""
        return self.sso.url


@contextmanager
def sso_front(tmp: Path, admin_url: str) -> Iterator[SsoFront]:
    sso_port, port = free_port(), free_port()
    sso = Process(
        [sys.executable, str(ROOT / "tests" / "support" / "sso_app.py"), str(sso_port)],
        sso_port,
        "sso",
    )
    home = tmp / f"nginx-{port}"
    home.mkdir()
    location = documented_location().replace("http://127.0.0.1:9090", admin_url)
    conf = f"""
daemon off;
worker_processes 1;
pid {home}/nginx.pid;
error_log {home}/error.log;
events {{ worker_connections 64; }}
http {{
  access_log {home}/access.log;
  client_body_temp_path {home}/body;
  proxy_temp_path {home}/proxy;
  fastcgi_temp_path {home}/fastcgi;
  uwsgi_temp_path {home}/uwsgi;
  scgi_temp_path {home}/scgi;
  server {{
    listen 127.0.0.1:{port};
    # oauth2-proxy's own endpoints, as its docs have nginx pass them on
    location /oauth2/ {{ proxy_pass {sso.url}; }}
    location = /oauth2/auth {{
      internal;
      proxy_pass {sso.url};
      proxy_pass_request_body off;
      proxy_set_header Content-Length "";
    }}
{location}
  }}
}}
"""
    (home / "nginx.conf").write_text(conf)
    nginx = Process(
        [
            nginx_binary(),
            "-p",
            str(home),
            "-e",
            str(home / "error.log"),
            "-c",
            str(home / "nginx.conf"),
        ],
        port,
        "nginx",
    )
    started: list[Process] = []
    try:
        started.append(sso.start())
        started.append(nginx.start())
        yield SsoFront(nginx, sso)
    finally:
        for process in reversed(started):
            process.stop()
