"""Attack upstream: answers each request with raw bytes chosen by the caller.

    python attack/rawup.py PORT

Any path: counts the run under its Idempotency-Key header value (repr of raw bytes), and
answers bytes.fromhex(query 'r') if given (else a plain 200). 'close=1' closes after.
GET /_count      -> JSON {key: runs}
GET /_log        -> JSON list of request lines and headers received
/_status/...     -> logged; answered with query-independent mode from STATUS env (default 404)
"""
import asyncio, json, os, re, sys
from urllib.parse import unquote
ran: set = set()
from collections import Counter
from urllib.parse import urlsplit, parse_qs

counts: Counter[str] = Counter()
log: list[dict] = []

def ok(body: bytes, status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body

async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, target, _ = lines[0].split(b" ", 2)
            headers = [l.split(b":", 1) for l in lines[1:] if b":" in l]
            hd = {k.strip().lower(): v.strip() for k, v in headers}
            n = int(hd.get(b"content-length", b"0"))
            body = await reader.readexactly(n) if n else b""
            t = target.decode("latin-1")
            u = urlsplit(t)
            q = parse_qs(u.query, keep_blank_values=True)
            log.append({"method": method.decode(), "target": t, "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers], "body": body.decode("latin-1")})
            if u.path == "/_count":
                writer.write(ok(json.dumps(counts).encode())); await writer.drain(); continue
            if u.path == "/_log":
                writer.write(ok(json.dumps(log).encode())); await writer.drain(); continue
            route_path = unquote(u.path) if os.environ.get("DECODE") else u.path
            m = re.fullmatch(r"/_status/([^/]*)/check", route_path)
            if m or route_path == "/_q/check":
                want = (m.group(1) if os.environ.get("DECODE") else unquote(m.group(1))) if m else q.get("key", [None])[0]
                st = "200 OK" if want in ran else "404 Not Found"
                writer.write(ok(b"{}", st)); await writer.drain(); continue
            if not u.path.startswith("/jobs/"):
                writer.write(ok(b"{}", "404 Not Found")); await writer.drain(); continue
            ran.add(unquote(hd.get(b"idempotency-key", b"").decode("latin-1")))
            key = repr(hd.get(b"idempotency-key", b"")) + " " + u.path
            counts[key] += 1
            if "sleep" in q:
                await asyncio.sleep(float(q["sleep"][0]))
            if "r" in q:
                writer.write(bytes.fromhex(q["r"][0]))
            else:
                writer.write(ok(b'{"ok":true}'))
            await writer.drain()
            if "close" in q:
                writer.close(); return
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        writer.close()

async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()

asyncio.run(main())
