"""Many shapes x many fault schedules, a few runs at a time: what the test and the benchmark run.

    results = campaign(range(8), schedules_per_shape=4, workdir=tmp, jobs=2, on_result=print)

Each shape is run fault-free first (the reference: it must complete with the model's ledger and
states; its wall time sets the shape's time bound and its final states are what every faulted run
must end with), then under each of its schedules. Shapes go in parallel
(`jobs`), the runs of one shape one after another. `shape_kw` goes to `random_shape` (`ranks=True`,
`scale=True`, `holds=True`, `ragged`, sizes); `scale=True` also gives every schedule a scale event pair.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flowrl.testing.chaos.check import read_final_states
from flowrl.testing.chaos.features import Features
from flowrl.testing.chaos.model import simulate
from flowrl.testing.chaos.schedules import Schedule, random_schedule
from flowrl.testing.chaos.shapes import Shape, random_shape
from flowrl.testing.chaos.trial import TrialResult, run_shape


def plan(shape_seeds, schedules_per_shape: int, features: Features | None = None, total: int | None = None,
         extra: dict[int, list[Schedule]] | None = None, **shape_kw) -> list[tuple[Shape, list[Schedule]]]:
    """The shapes and their schedules (no runs): deterministic for the same seeds and features.
    `total`: stop after that many schedules (the last shape gets fewer). `extra`: schedules written
    by hand, by shape seed, run after the drawn ones."""
    features = features or Features.detect()
    out, left = [], total if total is not None else float("inf")
    for s in shape_seeds:
        if left <= 0:
            break
        shape = random_shape(s, **shape_kw)
        expected = simulate(shape)
        n = int(min(schedules_per_shape, left))
        left -= n
        out.append((shape, [random_schedule(shape, expected, k, features, scale=shape_kw.get("scale", False))
                            for k in range(n)] + list((extra or {}).get(s, []))))
    return out


def campaign(shape_seeds, schedules_per_shape: int, workdir: Path, *, jobs: int = 1,
             features: Features | None = None, on_result: Callable[[Shape, TrialResult], None] | None = None,
             references: bool = True, total: int | None = None, extra: dict[int, list[Schedule]] | None = None,
             **shape_kw) -> list[TrialResult]:
    """Run every schedule of every shape (and the `extra` ones, by shape seed); returns the results
    (references first per shape)."""
    features = features or Features.detect()
    work = plan(shape_seeds, schedules_per_shape, features, total, extra, **shape_kw)
    lock = threading.Lock()
    results: list[TrialResult] = []

    def report(shape, res):
        with lock:
            results.append(res)
            if on_result:
                on_result(shape, res)

    def one_shape(shape: Shape, schedules: list[Schedule]) -> None:
        expected = simulate(shape)
        ref_wall, ref_states = None, None
        if references:
            ref = run_shape(shape, Path(workdir) / f"shape{shape.seed}" / "ref", None, features=features,
                            expected=expected)
            if ref.outcome == "completed":
                ref_wall = ref.wall_s
                try:
                    ref_states = read_final_states(Path(ref.run_dir))[1] or None
                except Exception:  # noqa: BLE001 - reported by the reference's own check
                    ref_states = None
            report(shape, ref)
        for sched in schedules:
            res = run_shape(shape, Path(workdir) / f"shape{shape.seed}" / sched.id, sched, features=features,
                            ref_wall_s=ref_wall, expected=expected, reference_states=ref_states)
            report(shape, res)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(one_shape, shape, schedules) for shape, schedules in work]:
            f.result()
    return results
