"""Operator name with a C1 control (U+0085 NEL) or other whitespace-only text: which answer?"""
import json, sys, time, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway
SHARED = "shared-token-0123456789abcdef"
UP = upstream()
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin: {{listen: "127.0.0.1:$ADMIN", token: "{SHARED}"}}
store: {{url: "memory://"}}
routes:
  - {{name: async, match: {{path: /jobs/x}}, upstream: {UP}, key: {{header: Idempotency-Key}}, delivery: async, retry: {{attempts: 1}}}}
""")
busy = (b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n").hex()
httpx.post(f"{GW}/jobs/x?r={busy}", headers={"Idempotency-Key": "k1"}); time.sleep(1.5)
H = {"Authorization": f"Bearer {SHARED}", "Content-Type": "application/json"}
for name in ["\x85", "a\x85b", "\x85a", "a\x85", "\u00a0", "\u3000", "\u2028", "a\u2029", "\x1c", "a\x1fb", "\x0b", "a\x0bb", "\x0c", "\t", "a\tb"]:
    r = httpx.post(f"{ADMIN}/admin/key/claim", params={"route": "async", "key": "k1"}, headers=H, content=json.dumps({"operator": name}))
    print(f"{name!r:12} {r.status_code} {r.json().get('type','').rsplit('/',1)[-1]:22} {r.json().get('field')} {r.json().get('detail','')[:90]}")
    if r.status_code == 200:
        httpx.post(f"{ADMIN}/admin/key/resolve", params={"route": "async", "key": "k1"}, headers=H, content=json.dumps({"operator": name, "outcome": "retry", "note": "x"}))
        print("   claimed as", repr(httpx.get(f"{ADMIN}/admin/key", params={"route": "async", "key": "k1"}, headers=H).json().get("holder")))
