"""Live-channel fuzz in CI: 20,000 hostile messages and two abort bursts into a running consumer (a
flowrl Receiver in its own process) while a legitimate producer streams a known sequence through
it: no crash, no lost or duplicated batch, and the legitimate stream served while the attack runs.
`python benchmarks/fuzz_channels.py` runs the same with more messages, prints the table and holds
the longest stall of the legitimate stream under 2 s (a speed, so measured there, not here)."""

import pytest

from tests.transport.live_fuzz import fuzz, table


@pytest.mark.timeout(150)
def test_hostile_traffic_neither_crashes_a_consumer_nor_loses_duplicates_or_stalls_its_legit_stream(capsys):
    r = fuzz(count=20_000, batches=3000, bursts=2, seed=12)
    with capsys.disabled():
        print("\n" + table(r))
    assert r["consumer_event"] == "done" and r["consumer_exit"] == 0  # ended by end-of-stream, not a crash
    assert r["hostile_messages"] >= 20_000 and r["abort_bursts"] == 2
    assert r["legit_received"] == r["legit_unique"] == 3000 and r["legit_in_order"]
    assert r["legit_during_attack"] > 0  # not starved until the attack was over
    st = r["stats"]
    assert st["rejected"] >= 10_000  # the hostile traffic reached the consumer and was turned away
    assert st["rejected_by_reason"].get("replay", 0) >= 1 and st["rejected_by_reason"].get("bad_proof", 0) >= 1
    assert "internal" not in st["rejected_by_reason"]  # every hostile message refused by name, none by a bug
    assert r["rss_after_mb"] - r["rss_before_mb"] < 200
