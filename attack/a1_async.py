"""Attack 1 (async): odd statuses on a `delivery: async` route; poll status; count runs."""
import sys, time, uuid, httpx
sys.path.insert(0, __import__("os").path.dirname(__file__))
from harness import upstream, gateway
from a1_cases import CASES

UP = upstream()
GW, ADMIN, P, CFG = gateway(f"""
server: {{listen: "127.0.0.1:$PORT"}}
admin: {{listen: "127.0.0.1:$ADMIN"}}
store: {{url: "memory://"}}
routes:
  - name: async
    match: {{path: /jobs/async}}
    upstream: {UP}
    key: {{header: Idempotency-Key}}
    upstream_timeout: 3s
    fingerprint: none
    delivery: async
    retry: {{attempts: 3, backoff: 200ms, max_backoff: 1s}}
""")
print(f"{'case':28} {'state':>40} runs")
for name, r in CASES.items():
    key = "k-" + uuid.uuid4().hex[:8]
    a = httpx.post(f"{GW}/jobs/async?r={r}", headers={"Idempotency-Key": key}, timeout=10)
    url = a.headers.get("location")
    state = None
    for _ in range(40):
        s = httpx.get(GW + url if url.startswith("/") else url, timeout=5)
        try: state = s.json().get("state")
        except Exception: state = s.status_code
        if state not in ("queued", "delivering", "retrying", "pending", "in_progress"):
            break
        time.sleep(0.25)
    time.sleep(1.2)
    httpx.post(f"{GW}/jobs/async?r={r}", headers={"Idempotency-Key": key}, timeout=10)
    time.sleep(0.3)
    counts = httpx.get(f"{UP}/_count").json()
    runs = sum(v for k, v in counts.items() if key in k)
    print(f"{name:28} {str(state)+' '+str(s.json().get('upstream_status', '') if s.headers.get('content-type','').startswith('application/json') else ''):>40} {runs:>4}")
