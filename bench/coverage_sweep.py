"""The coverage sweep: every transformers causal-LM / masked-LM / seq2seq-LM / image-classification
model type and a seeded sample of 100 timm models, one simulated step each at batch 2 (estimator/testing/coverage.py).

    python bench/coverage_sweep.py [--only causal-lm,timm] [--limit N] [--deadline HH:MM] [--json out.json]

Prints one line per type as it goes, then per-task counts simulates / 422 / fails and the failure reasons grouped.
``--deadline`` (UTC) stops starting new types after that time and says the figures are partial.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections import Counter, defaultdict

from estimator.testing.coverage import Outcome, all_keys, exclusions, run_one


def _group(reason: str) -> str:
    """A failure reason without its specifics (numbers, quoted names), to count alike failures together."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|`[^`]*`", "'…'", reason))[:160]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated tasks (causal-lm, masked-lm, seq2seq-lm, "
                    "image-classification, timm)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many types per task")
    ap.add_argument("--deadline", default="", help="UTC HH:MM after which no new type starts")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per type")
    ap.add_argument("--json", default="", help="write every outcome here")
    args = ap.parse_args()
    keys = all_keys()
    if args.only:
        wanted = set(args.only.split(","))
        keys = [k for k in keys if k.split(":", 1)[0] in wanted]
    if args.limit:
        seen: Counter[str] = Counter()
        kept = []
        for k in keys:
            task = k.split(":", 1)[0]
            if seen[task] < args.limit:
                kept.append(k)
                seen[task] += 1
        keys = kept
    stop = None
    if args.deadline:
        h, m = map(int, args.deadline.split(":"))
        now = datetime.datetime.now(datetime.UTC)
        stop = now.replace(hour=h, minute=m, second=0, microsecond=0)
    outcomes: list[Outcome] = []
    partial = False
    for key in keys:
        if stop is not None and datetime.datetime.now(datetime.UTC) >= stop:
            partial = True
            break
        o = run_one(key, args.timeout)
        outcomes.append(o)
        print(f"{o.status:9} {o.seconds:6.1f}s {o.key}  {o.reason}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([o.__dict__ for o in outcomes], f, indent=1)
    by_task: dict[str, Counter[str]] = defaultdict(Counter)
    reasons: dict[str, Counter[str]] = defaultdict(Counter)
    example: dict[str, str] = {}
    for o in outcomes:
        task = o.key.split(":", 1)[0]
        by_task[task][o.status] += 1
        if o.status != "simulates":
            g = f"{o.status} {_group(o.reason)}"
            reasons[task][g] += 1
            example.setdefault(f"{task} {g}", o.key)
    print(f"\n{'PARTIAL: ' if partial else ''}{len(outcomes)} of {len(keys)} types swept")
    print(f"{'task':22} {'types':>5} {'simulates':>9} {'422':>5} {'fails':>5}")
    for task, c in by_task.items():
        n = sum(c.values())
        print(f"{task:22} {n:5} {c['simulates']:9} {c['422']:5} {c['fails']:5}  ({100 * c['simulates'] / n:.0f} %)")
    for task, c in reasons.items():
        print(f"\n{task}:")
        for g, n in c.most_common():
            print(f"  {n:3} x {g}   e.g. {example[f'{task} {g}']}")
    excluded = exclusions()
    stale = [o.key for o in outcomes if o.status == "simulates" and o.key in excluded]
    if stale:
        print("\nexcluded but simulating now:", ", ".join(stale))
    secs = [o.seconds for o in outcomes]
    if secs:
        print(f"\n{sum(secs):.0f} s in all, {sum(secs) / len(secs):.1f} s per type, slowest {max(secs):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
