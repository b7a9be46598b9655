"""The PostgreSQL store's statements alone, by pgbench: the database's CPU per first
request (claim + completion of a new key) and per replay (the claim of a completed
key), with no gateway in the way.

    .venv/bin/python tests/benchmarks/pg_statements.py [--runs 3] [--duration 8]
        [--clients 32] [--baseline-src DIR]

One PostgreSQL in a temp dir (tests/support/postgres.py: fsync and synchronous_commit
on), `pgbench -M prepared -j 1` (C, so the client costs the cores little), each
transaction the very SQL files of gateway/store/postgres/sql/ with their parameters filled in
(expanded by the tree's own postgres_sql.expand), autocommit per statement as the store
runs them. The database's CPU is the postmaster's and its processes' (the backends that
exit when pgbench ends are counted in the postmaster's cutime). With `--baseline-src`,
another checkout's migrations and statements run in a database of their own on the
same server, alternating with this tree's in each run; the last table gives the ratio
per run. Workloads: `first` (a new key per transaction; this tree's claim inserts
first, as on a route whose last claim took a new key), `replay` (one of 1,000 completed
keys; this tree's claim reads first, as on a route whose last claim found a record) and,
for this tree only, `first-read` and `replay-insert` (the other order of each), and
`first-x4` and `replay-x4` (the group commit's batched statements, BATCH keys in one
statement: the database's CPU per key is the transaction's / BATCH). This
tree's completions do not write the last success (it is asked for once a second per
route); the baseline's do unless `--baseline-success false`. Nothing here fails on a
figure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from tests.support.postgres import PostgresServer, pg_binary  # noqa: E402

RESPONSE = "convert_to(repeat('x', 300), 'UTF8')"
#: Each statement's parameters as pgbench fills them ($n -> SQL); :d is the key.
ARGS = {
    "claim": {1: ":d::text", 2: "'jobs'", 3: ":d::text", 4: ":d::text", 5: "'fp'", 6: "30000",
              7: "'unresolved'", 8: "{fresh}"},
    "complete": {1: ":d::text", 2: ":d::text", 3: RESPONSE, 4: "86400000", 5: "'upstream'",
                 6: "NULL", 7: "{success}"},
}  # fmt: skip
#: Keys per transaction of the `-x4` workloads: the group commit's statements
#: (claim_batch.sql, complete_batch.sql), each entry's parameters as claim.sql's and
#: complete.sql's in ARGS, the arrays' elements one per key.
BATCH = 4
#: workload -> (statements, keys drawn from, the claim's order)
WORKLOADS = {
    "first": (("claim", "complete"), 10**12, "true"),
    "replay": (("claim",), 1000, "false"),
    "first-read": (("claim", "complete"), 10**12, "false"),
    "replay-insert": (("claim",), 1000, "true"),
    "first-x4": (("claim_batch", "complete_batch"), 10**12, "true"),
    "replay-x4": (("claim_batch",), 1000, "false"),
}
PRIME = (
    "INSERT INTO gateway_records (prefix, digest, route, key, state, run_id, fingerprint,"
    " created_ms, since_ms, expires_ms, response) SELECT 'idem', g::text, 'jobs', g::text,"
    " 'completed', g::text, 'fp', gateway_now_ms(), gateway_now_ms(),"
    f" gateway_now_ms() + 86400000, {RESPONSE} FROM generate_series(1, 1000) g"
)


def emit(workload: str, success: str) -> str:
    """The pgbench script of `workload` from the statements of the tree on sys.path;
    `success`: whether each completion writes the route's last success."""
    from gateway.store.postgres.database import expand, sql_file

    names, keys, fresh = WORKLOADS[workload]
    lines = [f"\\set d random(1, {keys})"]
    lines += [f"\\set d{i} random(1, {keys})" for i in range(BATCH) if workload.endswith("x4")]
    for name in names:
        # no ":" in a literal: pgbench would read a variable there
        sql = expand(sql_file(name), "idem", "idem_c")
        sql = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
        single = name.removesuffix("_batch")
        values = {
            f"${n}": value.format(fresh=fresh, success=success) for n, value in ARGS[single].items()
        }
        if name != single:  # one array per parameter, an element per key (d0 .. d3)
            values = {
                n: "ARRAY[" + ", ".join(v.replace(":d", f":d{i}") for i in range(BATCH)) + "]"
                for n, v in values.items()
            }
        # longest first: $1 must not take the front of $10
        for n in sorted(values, key=len, reverse=True):
            sql = sql.replace(n, values[n])
        lines.append(sql.strip() + ";")
    return "\n".join(lines) + "\n"


def migrate(url: str) -> None:
    """The tree on sys.path migrates the database at `url` to its schema."""
    from tests.conftest import migrate_database

    migrate_database(url)


def in_tree(src: Path, *args: str) -> str:
    """This script's `--emit`/`--migrate` run with `src`'s gateway package."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.run(argv, env=env, cwd=src, check=True, capture_output=True, text=True).stdout


def db_cpu(server: PostgresServer) -> float:
    """CPU seconds of the postmaster, its live processes and its exited children."""
    assert server.proc is not None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in (server.proc.pid, *server.children()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
        if pid == server.proc.pid:
            total += int(fields[13]) + int(fields[14])  # cutime, cstime: exited backends
    return total / ticks


def bench(
    server: PostgresServer, database: str, script: Path, workload: str, args: argparse.Namespace
) -> tuple[float, float]:
    """(transactions per second, database CPU us per transaction) of one pgbench run."""
    url = server.dsn(database)
    subprocess.run([pg_binary("psql"), url, "-qc", "TRUNCATE gateway_records"], check=True)
    if workload.startswith("replay"):
        subprocess.run([pg_binary("psql"), url, "-qc", PRIME], check=True)
    subprocess.run([pg_binary("psql"), url, "-qc", "CHECKPOINT"], check=True)
    before = db_cpu(server)
    out = subprocess.run(
        [pg_binary("pgbench"), "-n", "-M", "prepared", "-j", "1", "-c", str(args.clients),
         "-T", str(args.duration), "-f", str(script), url],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"pgbench failed: {out.stderr.strip()}")
    used = db_cpu(server) - before
    done = int(re.search(r"actually processed: (\d+)", out.stdout)[1])  # type: ignore[index]
    return done / args.duration, used / max(done, 1) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--duration", type=int, default=8)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--baseline-src", default="")
    p.add_argument(
        "--baseline-success",
        default="true",
        help="the baseline's completions write the last success (true: a tree from before "
        "the once-a-second rule, whose every completion below 500 asked for it)",
    )
    p.add_argument("--emit", help=argparse.SUPPRESS)
    p.add_argument("--migrate", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.emit:
        workload, success = args.emit.split(",")
        print(emit(workload, success), end="")
        return 0
    if args.migrate:
        migrate(args.migrate)
        return 0
    trees = {"this": REPO}
    if args.baseline_src:
        trees["base"] = Path(args.baseline_src).resolve()
    server = PostgresServer().start()
    work = Path(tempfile.mkdtemp(prefix="pg-statements-"))
    try:
        cells: list[tuple[str, str, Path]] = []
        for tree, src in trees.items():
            server.sql(f"CREATE DATABASE {tree}")
            in_tree(src, "--migrate", server.dsn(tree))
            for workload in WORKLOADS if tree == "this" else ("first", "replay"):
                script = work / f"{tree}-{workload}.sql"
                # This tree asks for the last success once a second per route: none of
                # the transactions here.
                success = args.baseline_success if tree == "base" else "false"
                script.write_text(in_tree(src, "--emit", f"{workload},{success}"))
                cells.append((tree, workload, script))
        found: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for run in range(args.runs):
            for tree, workload, script in cells if run % 2 == 0 else cells[::-1]:
                tps, cpu = bench(server, tree, script, workload, args)
                found.setdefault((tree, workload), []).append((tps, cpu))
                print(
                    f"# run {run} {tree:<5} {workload:<13} {tps:8,.0f}/s  {cpu:5.0f} us", flush=True
                )
    finally:
        server.stop()
        server.remove()
    print(f"\npgbench -M prepared -c {args.clients} -j 1 -T {args.duration}, {args.runs} runs")
    print(f"\n(a `-x4` transaction is {BATCH} keys' statements in one: per key, divide by {BATCH})")
    print("\n| tree | workload | transactions/s | database CPU us per transaction (per run) |")
    print("|---|---|--:|--:|")
    for (tree, workload), rows in found.items():
        tps = statistics.median(r[0] for r in rows)
        cpus = [r[1] for r in rows]
        each = ", ".join(f"{c:.0f}" for c in cpus)
        print(f"| {tree} | {workload} | {tps:,.0f} | {statistics.median(cpus):.0f} ({each}) |")
    if "base" in trees:
        print("\n| workload | database CPU, this / base, per run | median |")
        print("|---|---|--:|")
        for workload in ("first", "replay"):
            ratios = [
                a[1] / b[1]
                for a, b in zip(found[("this", workload)], found[("base", workload)], strict=True)
            ]
            each = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"| {workload} | {each} | **{statistics.median(ratios):.2f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
