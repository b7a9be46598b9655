"""Attack 4a: do a viewer (or operator) see secret header/query values of a stored
async request or response? Every secret is spelled SECRET<n>; grep every surface."""
import re, sys, time, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway

VT, OT = "viewer-token-0123456789abcdef", "operat-token-0123456789abcdef"
open("/tmp/attack23-vera", "w").write(VT + "\n")
UP = upstream()
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin:
  listen: "127.0.0.1:$ADMIN"
  operators:
    - {{name: vera, role: viewer, token_file: /tmp/attack23-vera}}
    - {{name: olga, role: operator, token_env: OLGA}}
  session_secret_env: SESS
  show_headers: [X-Tenant]
  show_query: [page]
store: {{url: "memory://"}}
routes:
  - name: async
    match: {{path: "/jobs/{{rest:path}}"}}
    upstream: {UP}
    key: {{header: Idempotency-Key}}
    fingerprint: none
    delivery: async
    retry: {{attempts: 1, backoff: 100ms}}
""", env={"OLGA": OT, "SESS": "s" * 40})

def resp(status_line, headers="", body=b""):
    return (f"{status_line}\r\n{headers}content-length: {len(body)}\r\n\r\n".encode() + body).hex()

SECRET_RESP = ("set-cookie: sid=SECRET10\r\nx-token: SECRET11\r\nlocation: /r?sig=SECRET12\r\n"
               "link: </x?t=SECRET13>\r\nwww-authenticate: Bearer SECRET14\r\netag: \"e\"\r\n"
               "content-type: text/plain; charset=SECRET15\r\nx-tenant: SECRET16\r\nvary: *\r\n")
cases = {"parked503": resp("HTTP/1.1 503 Busy", SECRET_RESP, b"body SECRET17"),
         "done200": resp("HTTP/1.1 200 OK", SECRET_RESP, b"body SECRET18"),
         "done302": resp("HTTP/1.1 302 Found", SECRET_RESP)}
keys = {}
for name, r in cases.items():
    key = f"{name}-{uuid.uuid4().hex[:6]}"
    keys[name] = key
    url = (f"{GW}/jobs/{name};jsessionid=SECRET20?r={r}&api_key=SECRET1&API_KEY=SECRET2&page=1"
           f"&Page=SECRET3&pag%65=p&api%5Fkey=SECRET4&=SECRET5&token&x=SECRET6&x=SECRET7"
           f"&idempotency-key=SECRET8")
    a = httpx.post(url, headers={"Idempotency-Key": key, "X-Api-Key": "SECRET21",
                  "Authorization": "Bearer SECRET22", "Cookie": "a=SECRET23", "X-Tenant": "t1",
                  "Proxy-Authorization": "Basic SECRET24", "X-Signature": "SECRET25",
                  "Forwarded": "for=SECRET26", "X-Forwarded-For": "SECRET27",
                  "Content-Type": "application/json", "Idempotency-Key-Extra": "SECRET28"},
                  content=b'{"card":"SECRET29"}')
    print(name, a.status_code)
time.sleep(2.5)
found = {}
def scan(where, text):
    hits = sorted(set(re.findall(r"SECRET\d+", text)))
    print(f"{where:55} {hits}")
for who, tok in [("viewer", VT), ("operator", OT)]:
    H = {"Authorization": f"Bearer {tok}"}
    for name, key in keys.items():
        scan(f"{who} GET /admin/key {name}", httpx.get(f"{ADMIN}/admin/key", params={"route": "async", "key": key}, headers=H).text)
        scan(f"{who} GET /admin/keys/async/key {name}", httpx.get(f"{ADMIN}/admin/keys/async/{key}", headers=H).text)
    scan(f"{who} GET /admin/keys all states", httpx.get(f"{ADMIN}/admin/keys?state=unresolved,parked,claimed,in_flight,queued,retrying", headers=H).text)
    scan(f"{who} GET /admin/overview", httpx.get(f"{ADMIN}/admin/overview", headers=H).text)
    c = httpx.Client(base_url=ADMIN, headers={"Origin": ADMIN})
    r = c.post("/console/signin", data={"token": tok, "next": "/console/"})
    print(who, "signin", r.status_code)
    for name, key in keys.items():
        page = c.get("/console/key", params={"route": "async", "key": key})
        scan(f"{who} console key page {name} ({page.status_code})", page.text)
    scan(f"{who} console keys", c.get("/console/keys?state=parked,unresolved").text)
for name, key in keys.items():
    s = httpx.get(f"{GW}/_idempotency/status/", timeout=3)
print("metrics", re.findall(r"SECRET\d+", httpx.get(f"{ADMIN}/metrics").text))
print("gateway log", sorted(set(re.findall(r"SECRET\d+", open(P.args[0] and f"/tmp/attack23-gw-{GW.rsplit(':',1)[1]}.log").read()))))
