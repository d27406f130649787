"""Credit pool of a consumer: memory stays within capacity whatever producers do, and nobody starves."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.transport.flow import CreditPool
from flowrl.transport.link import Link


def committed(pool: CreditPool) -> tuple[int, int]:
    m = sum(a.unused_m + a.held_m for a in pool.accounts.values()) + pool.orphan_m
    b = sum(a.unused_b + a.held_b for a in pool.accounts.values()) + pool.orphan_b
    return m, b


def check(pool: CreditPool) -> None:
    m, b = committed(pool)
    assert (m, b) == (pool.used_m, pool.used_b)
    assert m <= pool.cap_m and b <= pool.cap_b
    assert all(a.unused_m >= 0 and a.unused_b >= 0 for a in pool.accounts.values())


def live(pool: CreditPool) -> None:
    """Progress: when the consumer holds nothing and some link waits, a waiting link got what it
    needs, or a link that waits for nothing holds credit (it sends, or goes idle and hands it back)."""
    accts = [a for a in pool.accounts.values() if a.open]
    waiting = [a for a in accts if a.need]
    if not waiting or pool.orphan_m or any(a.held_m for a in accts):
        return
    assert any(a.unused_m >= 1 and a.unused_b >= a.need for a in waiting) \
        or any(not a.need and (a.unused_m or a.unused_b) for a in accts), [(a.unused_m, a.unused_b, a.need) for a in accts]


def test_a_single_producer_gets_the_whole_capacity():
    pool = CreditPool(8, 1000)
    pool.add("p")
    assert pool.regrant() == ["p"]
    a = pool.accounts["p"]
    assert (a.lim_m, a.lim_b) == (8, 1000)
    check(pool)


def test_two_active_producers_share_the_capacity_and_acks_refill_it():
    pool = CreditPool(8, 1000)
    pool.add("p"), pool.add("q")
    pool.regrant()
    for k in ("p", "q"):
        assert pool.accounts[k].lim_m == 4
    for _ in range(4):
        assert pool.can_accept("p", 100)
        pool.on_data("p", 100)
    assert not pool.can_accept("p", 100)  # out of messages: a fifth would be a protocol violation
    pool.on_ack("p", 100)
    pool.regrant()
    assert pool.can_accept("p", 100)
    check(pool)


def test_a_blocked_large_message_is_served_before_anyone_else_gets_more():
    pool = CreditPool(10, 1000)
    pool.add("small"), pool.add("big")
    pool.regrant()  # 5 messages, 500 bytes each
    for _ in range(5):
        pool.on_data("small", 100)
    pool.on_hello("big", need=900, idle=False, ret_m=0, ret_b=0)
    pool.regrant()
    assert pool.accounts["big"].unused_b < 900  # not yet: `small` holds 500 bytes
    for _ in range(5):
        pool.on_ack("small", 100)
        pool.regrant()
        assert pool.accounts["small"].unused_m + pool.accounts["small"].held_m <= 5
    assert pool.accounts["big"].unused_b >= 900
    check(pool)


def test_an_idle_producer_hands_its_credit_back_and_gets_none_eagerly():
    pool = CreditPool(8, 800)
    pool.add("p"), pool.add("q")
    pool.regrant()
    pool.on_hello("q", need=0, idle=True, ret_m=4, ret_b=400)
    pool.regrant()
    assert pool.accounts["q"].unused_m == 0
    assert pool.accounts["p"].unused_m == 8  # the active one may use everything now
    check(pool)


def test_end_of_stream_and_a_lost_link_release_their_credit():
    pool = CreditPool(4, 400)
    pool.add("p")
    pool.regrant()
    pool.on_data("p", 100)
    pool.finish("p")
    assert pool.free_m == 3 and not pool.can_accept("p", 1)
    pool.add("q")
    pool.regrant()
    pool.on_data("q", 50)
    pool.remove("q")  # gone while its batch is still held by the consumer: an orphan
    assert pool.orphan_m == 1
    pool.on_orphan_ack(50)
    check(pool)


def test_a_need_larger_than_the_capacity_does_not_freeze_the_pool():
    pool = CreditPool(4, 100)
    pool.add("p"), pool.add("q")
    pool.on_hello("p", need=10_000, idle=False, ret_m=0, ret_b=0)
    assert "q" in pool.regrant()


def test_links_blocked_for_a_heartbeat_hand_their_credit_back_so_two_never_wait_for_each_other():
    """A producer link found blocked on a message at its heartbeat tick, nothing sent since the last,
    hands back what it holds unused (`Link.release_unused`, from the sender's tick). Before, a chaos run hung: link `a`, alone at
    first, had been topped up to the whole byte capacity; `b` joined and, first in line, waited for
    bytes while holding two messages; `a` spent its messages and then waited for one while holding
    nearly all the bytes. The pool kept what freed up for `b`, so neither ever sent again."""
    pool = CreditPool(4, 1 << 30, link_messages=2)
    links = {k: Link("consumer", 0, k.encode()) for k in "ab"}

    def hello(k):  # the producer's hello reaches the consumer, whose status comes back
        lk = links[k]
        pool.on_hello(k, lk.need, lk.idle, lk.ret_m, lk.ret_b)
        pool.regrant()
        for key, link in links.items():
            if key in pool.accounts:
                link.lim_m, link.lim_b = pool.accounts[key].lim_m, pool.accounts[key].lim_b

    def send(k, n):
        assert pool.can_accept(k, n)
        pool.on_data(k, n)
        links[k].sent_m, links[k].sent_b = links[k].sent_m + 1, links[k].sent_b + n
        for lk in links.values():
            lk.need = 0

    def blocked(k, n):  # as the sender: waiting for a message of n bytes (no credit for it)
        links[k].need, links[k].idle = n, False
        hello(k)

    def can_send(k, n) -> bool:
        return links[k].avail_m >= 1 and links[k].avail_b >= n

    pool.add("a")
    hello("a")
    assert (links["a"].avail_m, links["a"].avail_b) == (2, 1 << 30)  # alone: all the bytes
    pool.add("b")
    hello("b")
    assert links["b"].avail_m == 2 and links["b"].avail_b == 0
    blocked("b", 500)  # first in line: what frees up is kept for it
    for _ in range(2):
        send("a", 50)
    for _ in range(2):
        pool.on_ack("a", 50)
    hello("a")
    assert links["a"].avail_m == 0
    blocked("a", 50)
    assert not can_send("a", 50) and not can_send("b", 500)  # each holds what the other waits for
    for k in "ab":  # a heartbeat later, both still blocked
        links[k].release_unused()
        hello(k)
    assert can_send("a", 50) and can_send("b", 500)
    check(pool)


ops = st.lists(st.tuples(st.sampled_from(["add", "data", "ack", "hello", "finish", "remove", "orphan_ack"]),
                         st.integers(0, 3), st.integers(1, 300), st.booleans()), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_credit_never_exceeds_capacity_under_any_sequence_of_events(events):
    pool = CreditPool(6, 1000)
    held: dict[int, list[int]] = {}
    orphans: list[int] = []
    for op, k, size, flag in events:
        if op == "add" and k not in pool.accounts:
            pool.add(k)
            held[k] = []
        elif k not in pool.accounts:
            if op == "orphan_ack" and orphans:
                pool.on_orphan_ack(orphans.pop())
            continue
        elif op == "data" and pool.can_accept(k, size):
            pool.on_data(k, size)
            held[k].append(size)
        elif op == "ack" and held[k]:
            pool.on_ack(k, held[k].pop())
        elif op == "hello":  # waiting for `size` bytes (flag) or idle: either way, its unused credit goes back
            a = pool.accounts[k]
            pool.on_hello(k, need=size if flag else 0, idle=not flag, ret_m=a.ret_m + a.unused_m, ret_b=a.ret_b + a.unused_b)
        elif op == "finish":
            pool.finish(k)
        elif op == "remove":
            pool.remove(k)
            orphans.extend(held.pop(k))
        pool.regrant()
        check(pool)
        live(pool)

