"""Live-channel fuzz, benchmark size: hostile traffic (flowrl.transport.hostile) into a running
consumer while a legitimate producer streams a known sequence; prints what survived.

    python benchmarks/fuzz_channels.py                    # 200,000 hostile messages + 4 abort bursts
    python benchmarks/fuzz_channels.py --count 20000      # what CI runs (tests/transport/test_live_fuzz.py)
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.transport.live_fuzz import fuzz, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000, help="hostile messages (plus the abort bursts)")
    ap.add_argument("--bursts", type=int, default=4, help="abort bursts: 3,000 messages, then a disconnect")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    batches = max(3000, args.count // 7)  # the legitimate stream lasts as long as the attack (3 ms apart)
    r = fuzz(count=args.count, batches=batches, bursts=args.bursts, seed=args.seed, timeout=60 + args.count / 200)
    print(table(r))
    ok = (r["consumer_event"] == "done" and r["consumer_exit"] == 0 and r["legit_in_order"]
          and r["legit_received"] == r["legit_unique"] == batches and r["max_gap_s"] < 2.0)
    print(f"\nverdict: {'PASS' if ok else 'FAIL'} (0 crashes, 0 lost or duplicated legit batches, no stall over 2 s)")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
