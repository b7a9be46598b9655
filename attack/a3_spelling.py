"""Attack 3: one spelling per key on the wire (forward, reconcile check, async delivery),
and no two keys spelled alike."""
import json, sys, time, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway
UP = upstream()
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin: {{listen: "127.0.0.1:$ADMIN"}}
store: {{url: "memory://"}}
defaults: {{fingerprint: none, upstream_timeout: 2s, key: {{body: k, max_length: 4096}}}}
routes:
  - name: sync
    match: {{path: /jobs/sync}}
    upstream: {UP}
    on_unknown_outcome: reconcile
    reconcile: {{url: "{UP}/_q/check?key={{key}}", every: 1h}}
  - name: async
    match: {{path: /jobs/async}}
    upstream: {UP}
    delivery: async
""")
KEYS = ["café", "caf%C3%A9", "caf%c3%a9", "50%", "50%25", '"x"', "x", "%22x%22", "a b", "a+b", "a%20b",
        "ÿ", "%FF", "\u00ff", "y\u0308", "\u00e9", "e\u0301", "日本", "\U0001f600", "a\\b", "a%5Cb", "a,b", "a;b",
        "k" * 4000, "k" * 3999 + "é", "\u2028x", "*", "?", "~", "%7E", "-._~", "%2D", "a\tb", "é" * 2000]
LOST = "&sleep=0.05&close=1&r="
spell = {}
for key in KEYS:
    body = json.dumps({"k": key}).encode()
    h = {"content-type": "application/json"}
    tag = uuid.uuid4().hex[:6]
    n0 = len(httpx.get(f"{UP}/_log").json())
    r1 = httpx.post(f"{GW}/jobs/sync?t={tag}{LOST}", content=body, headers=h)
    r2 = httpx.post(f"{GW}/jobs/sync?t={tag}{LOST}", content=body, headers=h)
    r3 = httpx.post(f"{GW}/jobs/async?t={tag}", content=body, headers=h)
    time.sleep(0.5)
    log = httpx.get(f"{UP}/_log").json()[n0:]
    got = {}
    for e in log:
        if e["target"].startswith("/_log") or e["target"].startswith("/_count"): continue
        kind = "check" if "/_q/check" in e["target"] else ("async" if "/jobs/async" in e["target"] else "sync")
        hv = [v for n, v in e["headers"] if n.lower() == "idempotency-key"]
        if kind == "check":
            from urllib.parse import urlsplit, parse_qs
            got.setdefault("check-query", parse_qs(urlsplit(e["target"]).query).get("key"))
        got.setdefault(kind, hv)
    spell[key] = got
    same = len({json.dumps(v) for k, v in got.items() if k != "check-query"}) == 1
    print(f"{key[:20]!r:24} {r1.status_code} {r2.status_code} {r3.status_code} one-spelling={same} {str(got)[:150]}")
seen = {}
for key, got in spell.items():
    s = json.dumps(got.get("sync"))
    if s in seen: print("COLLISION:", repr(seen[s][:30]), repr(key[:30]), s[:80])
    seen[s] = key
