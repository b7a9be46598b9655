"""Attack 1: odd upstream statuses on a sync route; count upstream runs per key.

Each case: two POSTs with the same key. 'handled' means the second must replay (1 run)."""
import sys, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway

def resp(status_line: str, headers: str = "", body: bytes = b"", cl=True) -> str:
    h = f"{status_line}\r\n{headers}"
    if cl:
        h += f"content-length: {len(body)}\r\n"
    return (h.encode() + b"\r\n" + body).hex()

UP = upstream()
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin: {{listen: "127.0.0.1:$ADMIN"}}
store: {{url: "memory://"}}
routes:
  - name: sync
    match: {{path: /jobs/sync}}
    upstream: {UP}
    key: {{header: Idempotency-Key}}
    upstream_timeout: 3s
    fingerprint: none
""")
CASES = {
    "100 then 200": "485454502f312e312031303020436f6e74696e75650d0a0d0a" + resp("HTTP/1.1 200 OK", body=b"x"),
    "103 then 201": resp("HTTP/1.1 103 Early Hints", "link: </a>; rel=preload\r\n", cl=False) + resp("HTTP/1.1 201 Created", body=b"x"),
    "199 then 200": resp("HTTP/1.1 199 Odd", cl=False) + resp("HTTP/1.1 200 OK"),
    "101 alone": resp("HTTP/1.1 101 Switching Protocols", "upgrade: websocket\r\nconnection: upgrade\r\n", cl=False),
    "299": resp("HTTP/1.1 299 Odd", body=b"x"),
    "399": resp("HTTP/1.1 399 Odd", body=b"x"),
    "499": resp("HTTP/1.1 499 Odd", body=b"x"),
    "599": resp("HTTP/1.1 599 Odd", body=b"x"),
    "600": resp("HTTP/1.1 600 Odd", body=b"x"),
    "999": resp("HTTP/1.1 999 Odd", body=b"x"),
    "000": resp("HTTP/1.1 000 Odd", body=b"x"),
    "junk status": resp("HTTP/1.1 2OO OK", body=b"x"),
    "no reason": resp("HTTP/1.1 200", body=b"x"),
    "HTTP/1.0 200": resp("HTTP/1.0 200 OK", body=b"x"),
    "HTTP/2 line": resp("HTTP/2 200", body=b"x"),
    "ICY 200": resp("ICY 200 OK", body=b"x"),
    "lowercase http": resp("http/1.1 200 OK", body=b"x"),
    "leading CRLF": "0d0a" + resp("HTTP/1.1 200 OK", body=b"x"),
    "302 no Location": resp("HTTP/1.1 302 Found"),
    "303 Location no body": resp("HTTP/1.1 303 See Other", "location: /x\r\n"),
    "304 with body": resp("HTTP/1.1 304 Not Modified", body=b"hello"),
    "204 with body": resp("HTTP/1.1 204 No Content", body=b"hello"),
    "408": resp("HTTP/1.1 408 Timeout"),
    "429 RA ²": resp("HTTP/1.1 429 Too Many", "retry-after: \u00b2\r\n".encode().decode("latin-1")),
    "503 RA huge": resp("HTTP/1.1 503 Busy", "retry-after: 99999999999999999999999999\r\n"),
    "503 RA neg": resp("HTTP/1.1 503 Busy", "retry-after: -5\r\n"),
    "503 RA date": resp("HTTP/1.1 503 Busy", "retry-after: Wed, 21 Oct 2015 07:28:00 GMT\r\n"),
    "200 with RA ²": resp("HTTP/1.1 200 OK", "retry-after: \u00b2\r\n".encode().decode("latin-1"), b"x"),
    "200 dup CL": resp("HTTP/1.1 200 OK", "content-length: 1\r\n", b"x"),
    "200 CL+TE": resp("HTTP/1.1 200 OK", "transfer-encoding: chunked\r\n", b"1\r\nx\r\n0\r\n\r\n"),
    "200 no framing close": resp("HTTP/1.1 200 OK", body=b"", cl=False) + b"abc".hex() + "&close=1",
    "200 header obs-fold": resp("HTTP/1.1 200 OK", "x-a: 1\r\n  folded\r\n", b"x"),
    "200 header NUL": resp("HTTP/1.1 200 OK", "x-a: a\x00b\r\n", b"x"),
    "200 header non-latin bytes": (b"HTTP/1.1 200 OK\r\nx-a: \xff\xfe\r\ncontent-length: 1\r\n\r\nx").hex(),
    "200 bad header name": resp("HTTP/1.1 200 OK", "x a: 1\r\n", b"x"),
}
print(f"{'case':28} {'first':>6} {'second':>6} runs  replayed")
for name, r in CASES.items():
    key = "k-" + uuid.uuid4().hex[:8]
    a = b = None
    for i in range(2):
        try:
            x = httpx.post(f"{GW}/jobs/sync?r={r}", headers={"Idempotency-Key": key}, timeout=10)
            if i == 0: a = x
            else: b = x
        except Exception as e:
            if i == 0: a = e
            else: b = e
    counts = httpx.get(f"{UP}/_count").json()
    runs = sum(v for k, v in counts.items() if key in k)
    st = lambda x: getattr(x, "status_code", type(x).__name__)
    rep = getattr(b, "headers", {}).get("idempotent-replayed", "") if b is not None else ""
    print(f"{name:28} {st(a)!s:>6} {st(b)!s:>6} {runs:>4}  {rep}")
    if len(sys.argv) > 1 and sys.argv[1] == "-v":
        for x in (a, b):
            if hasattr(x, "text"): print("   ", x.status_code, dict(x.headers), x.text[:300])
