"""Shared: start rawup + a gateway with the given routes (memory store)."""
import json, os, socket, subprocess, sys, time, atexit
from pathlib import Path
import httpx

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
procs: list[subprocess.Popen] = []

def free_port() -> int:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def wait_port(port: int, t: float = 20) -> None:
    end = time.time() + t
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close(); return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened")

def start(args, port, env=None, log=None):
    e = dict(os.environ); e.update(env or {}); e["PYTHONPATH"] = str(ROOT)
    out = open(log or f"/tmp/attack23-{port}.log", "w")
    p = subprocess.Popen(args, env=e, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    procs.append(p); wait_port(port); return p

@atexit.register
def _stop():
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try: p.wait(5)
            except Exception: p.kill()

def upstream(env=None):
    port = free_port()
    start([PY, str(ROOT / "attack/rawup.py"), str(port)], port, env)
    return f"http://127.0.0.1:{port}"

def gateway(config_text: str, env=None):
    port, admin = free_port(), free_port()
    cfg = Path(f"/tmp/attack23-cfg-{port}.yaml")
    cfg.write_text(config_text.replace("$PORT", str(port)).replace("$ADMIN", str(admin)))
    p = start([PY, "-m", "gateway", "run", "--config", str(cfg)], port, env, log=f"/tmp/attack23-gw-{port}.log")
    wait_port(admin)
    return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", p, cfg
