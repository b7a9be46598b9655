"""Attack 4b/4c: operator text (NUL, lone surrogates, huge) on a SQLite store, and
session ending on token rotation / removal + re-adding, with real SIGHUP reloads."""
import json, os, re, signal, sys, time, uuid, httpx
sys.path.insert(0, os.path.dirname(__file__))
from harness import upstream, gateway

T1, T2 = "vera-token-one-0123456789abcdef", "vera-token-two-0123456789abcdef"
OT, SHARED = "olga-token-0123456789abcdefgh", "shared-token-0123456789abcdef"
TF = "/tmp/attack23-vera2"; open(TF, "w").write(T1 + "\n")
DB = f"/tmp/attack23-{uuid.uuid4().hex[:6]}.db"
UP = upstream()
def config(with_olga=True, with_vera=True):
    ops = []
    if with_vera: ops.append("    - {name: vera, role: operator, token_file: %s}" % TF)
    if with_olga: ops.append("    - {name: olga, role: operator, token_env: OLGA}")
    return f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin:
  listen: "127.0.0.1:$ADMIN"
  token: "{SHARED}"
  operators:
{chr(10).join(ops)}
  session_secret_env: SESS
store: {{url: "sqlite://{DB}"}}
routes:
  - name: async
    match: {{path: "/jobs/{{rest:path}}"}}
    upstream: {UP}
    key: {{header: Idempotency-Key}}
    fingerprint: none
    delivery: async
    retry: {{attempts: 1, backoff: 100ms}}
"""
GW, ADMIN, P, CFG = gateway(config(), env={"OLGA": OT, "SESS": "s" * 40})
port, admin_port = GW.rsplit(":", 1)[1], ADMIN.rsplit(":", 1)[1]
def rewrite(text): CFG.write_text(text.replace("$PORT", port).replace("$ADMIN", admin_port))
def reload():
    P.send_signal(signal.SIGHUP); time.sleep(1.5)

busy = (b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n").hex()
keys = []
for i in range(40):
    k = f"park-{uuid.uuid4().hex[:6]}"; keys.append(k)
    httpx.post(f"{GW}/jobs/x?r={busy}", headers={"Idempotency-Key": k})
time.sleep(2)
SH = {"Authorization": f"Bearer {SHARED}", "Content-Type": "application/json"}
print("== operator text (shared token), claim/resolve")
def post(path, body, key, raw=None):
    r = httpx.post(f"{ADMIN}/admin/key/{path}", params={"route": "async", "key": key}, headers=SH,
                   content=raw if raw is not None else json.dumps(body).encode())
    return r.status_code, r.text[:160]
bad_texts = {"NUL": "a\x00b", "surrogate": "\\ud800", "pair-surrogate": "\\ud83d\\ude00", "huge": "x" * 2_000_000,
             "ESC": "\x1b[2J", "RLO": "a\u202eb", "C1": "\x85", "lone-low": "\\udfff", "nonchar": "\uffff", "tag": "\U000e0041"}
k = keys[0]
for name, t in bad_texts.items():
    raw_op = ('{"operator": "%s"}' % t).encode("utf-8", "surrogatepass") if "\\u" in t else None
    st = post("claim", {"operator": t}, k, raw_op)
    print(f"  claim operator={name:14} {st}")
k = keys[1]
print(post("claim", {"operator": "ann"}, k))
for name, t in bad_texts.items():
    raw = ('{"operator": "ann", "outcome": "done", "note": "%s"}' % t).encode("utf-8", "surrogatepass") if "\\u" in t else None
    print(f"  resolve note={name:14} {post('resolve', {'operator': 'ann', 'outcome': 'done', 'note': t}, k, raw)}")
fresh = iter(keys[2:])
for name, t in bad_texts.items():
    k = next(fresh); post("claim", {"operator": "ann"}, k)
    body = {"operator": "ann", "outcome": "done", "note": "n", "response": {"status": 200, "headers": {"x-a": "1"}, "body": t}}
    raw = json.dumps(body).replace(json.dumps(t)[1:-1], t).encode("utf-8", "surrogatepass") if "\\u" in t else None
    print(f"  resolve body={name:14} {post('resolve', body, k, raw)}")
for name, body in {"status huge": {"status": 10**5000}, "status float": {"status": 200.5}, "status str": {"status": "200"},
                   "hdr name NUL": {"status": 200, "headers": {"x\x00": "1"}}, "hdr val surrogate": None,
                   "body obj": {"status": 200, "body": {"a": "\x00"}}, "body nested deep": {"status": 200, "body": json.loads("[" * 500 + "]" * 500)}}.items():
    if body is None:
        k = next(fresh); post("claim", {"operator": "ann"}, k)
        raw = b'{"operator":"ann","outcome":"done","note":"n","response":{"status":200,"headers":{"x-a":"\\ud800"}}}'
        print(f"  resolve resp {name:14} {post('resolve', None, k, raw)}"); continue
    k = next(fresh); post("claim", {"operator": "ann"}, k)
    b = {"operator": "ann", "outcome": "done", "note": "n", "response": body}
    try: raw = json.dumps(b).encode()
    except ValueError: raw = ('{"operator":"ann","outcome":"done","note":"n","response":{"status":' + "9" * 5000 + "}}").encode()
    print(f"  resolve resp {name:14} {post('resolve', None, k, raw)}")
for q in [{"route": "async", "key": "\x00"}, {"route": "async\x00", "key": "a"}, {"route": "async", "key": "\ud800"}]:
    try:
        r = httpx.get(f"{ADMIN}/admin/key", params=q, headers=SH); print("  show", repr(q), r.status_code, r.text[:120])
    except Exception as e:
        r = httpx.get(f"{ADMIN}/admin/key?route=async&key=%ED%A0%80", headers=SH); print("  show %ED%A0%80", r.status_code, r.text[:120])
print("== sessions")
def console(tok):
    c = httpx.Client(base_url=ADMIN, headers={"Origin": ADMIN})
    r = c.post("/console/signin", data={"token": tok, "next": "/console/"}); assert r.status_code == 303, r.text[:300]
    return c
def alive(c):
    r = c.get("/console/keys"); return r.status_code == 200 and "signin" not in str(r.url) and 'name="token"' not in r.text
c1 = console(T1)
print("  vera session alive:", alive(c1))
open(TF, "w").write(T2 + "\n"); reload()
print("  after token_file rotated+SIGHUP, old session alive (want False):", alive(c1))
print("  old token API:", httpx.get(f"{ADMIN}/admin/me", headers={"Authorization": f"Bearer {T1}"}).status_code, "new:", httpx.get(f"{ADMIN}/admin/me", headers={"Authorization": f"Bearer {T2}"}).status_code)
c2 = console(T2); print("  new session alive:", alive(c2))
open(TF, "w").write(T1 + "\n"); reload()
print("  rotated back to T1: c1 alive (want False):", alive(c1), " c2 alive (want False):", alive(c2))
c3 = console(T1); print("  c3 (T1 again) alive:", alive(c3))
rewrite(config(with_vera=False)); reload()
print("  vera removed: c3 alive (want False):", alive(c3))
rewrite(config()); reload()
print("  vera re-added same token: c3 alive (want False):", alive(c3))
c4 = console(T1); print("  c4 alive:", alive(c4))
# whitespace/CRLF variations in the token file
for content in [T1 + "\r\n", T1 + "\n\n", " " + T1 + "\n", T1]:
    open(TF, "w").write(content); reload()
    print(f"  token file {content!r:44} c4 alive: {alive(c4)}  API: {httpx.get(f'{ADMIN}/admin/me', headers={'Authorization': f'Bearer {T1}'}).status_code}")
print("log tail:"); os.system(f"grep -i 'error\\|traceback' /tmp/attack23-gw-{port}.log | tail -5")
