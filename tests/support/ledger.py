"""The reliability ledger: what the fault, hostile-input and soak tests tried, and what held.

Tests that try to break the promise record their figures here (requests sent, faults
injected, bad inputs tried, duplicates that reached the upstream, records lost). At the
end of the session the totals are printed and written to `build/reliability.json`, so
`docs/reliability.md` can quote the figures of a real CI run instead of a hand count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIELDS = ("requests", "faults", "bad_inputs", "upstream_duplicates", "records_lost")


@dataclass
class Entry:
    area: str
    test: str
    requests: int = 0
    faults: int = 0
    bad_inputs: int = 0
    upstream_duplicates: int = 0
    records_lost: int = 0
    detail: str = ""


@dataclass
class Ledger:
    entries: list[Entry] = field(default_factory=list)

    def record(
        self,
        area: str,
        test: str,
        *,
        requests: int = 0,
        faults: int = 0,
        bad_inputs: int = 0,
        upstream_duplicates: int = 0,
        records_lost: int = 0,
        detail: str = "",
    ) -> None:
        """Add one test's figures. Record them *before* asserting the promise, so a
        failing run still reports what it saw."""
        self.entries.append(
            Entry(
                area,
                test,
                requests,
                faults,
                bad_inputs,
                upstream_duplicates,
                records_lost,
                detail,
            )
        )

    def totals(self) -> dict[str, dict[str, int]]:
        areas: dict[str, dict[str, int]] = {}
        for entry in self.entries:
            row = areas.setdefault(entry.area, {name: 0 for name in (*FIELDS, "tests")})
            row["tests"] += 1
            for name in FIELDS:
                row[name] += getattr(entry, name)
        return areas

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"totals": self.totals(), "entries": [asdict(e) for e in self.entries]}
        path.write_text(json.dumps(data, indent=2) + "\n")

    def table(self) -> list[str]:
        header = "| area | tests | " + " | ".join(FIELDS) + " |"
        lines = [header, "|---" * (len(FIELDS) + 2) + "|"]
        for area, row in sorted(self.totals().items()):
            cells = " | ".join(f"{row[name]:,}" for name in FIELDS)
            lines.append(f"| {area} | {row['tests']} | {cells} |")
        return lines


LEDGER = Ledger()
