"""Compare two runs' metrics.jsonl record by record: every field except the timing ones
(``*time_s``, ``tokens_per_s``); the RL phase's names before issue 25 (``grpo``,
``grpo_update``) read as today's (``rl``, ``rl_update``). Exit 1 on any difference.

    python benchmarks/compare_metrics.py BEFORE/metrics.jsonl AFTER/metrics.jsonl [--skip rl_update]
"""
from __future__ import annotations

import argparse
import json
import sys

OLD_PHASES = {"grpo": "rl", "grpo_update": "rl_update"}


def records(path: str, skip: set[str]) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            record["phase"] = OLD_PHASES.get(record["phase"], record["phase"])
            if record["phase"] not in skip:
                out.append({k: v for k, v in record.items() if not k.endswith("time_s") and k != "tokens_per_s"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--skip", default="", help="comma-separated phases to leave out (e.g. records one side lacks)")
    args = parser.parse_args()
    skip = {p for p in args.skip.split(",") if p}
    a, b = records(args.before, skip), records(args.after, skip)
    differences = [f"record count {len(a)} vs {len(b)}"] if len(a) != len(b) else []
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                differences.append(f"record {i} ({x.get('phase')} step {x.get('step')}) {key}: "
                                   f"{x.get(key)!r} vs {y.get(key)!r}")
    fields = sum(len(x) for x in a)
    print("\n".join(differences[:20]))
    print(f"{len(a)} records, {fields} fields, {len(differences)} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
