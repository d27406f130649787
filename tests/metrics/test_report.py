"""`flowrl report`: PNGs a person can read and a summary that names the known bottleneck."""

from __future__ import annotations

import re
import shutil

import pytest

from flowrl.metrics.report import ReportError, load_rows, make_report, main

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("scenario, bottleneck, starved", [
    ("rollout_bound", "rollout", "actor waits for input"),
    ("actor_bound", "actor", "rollout waits for credit"),
])
def test_report_writes_pngs_and_a_summary_naming_the_known_bottleneck(
        synthetic_runs, tmp_path, scenario, bottleneck, starved):
    run = tmp_path / scenario
    shutil.copytree(synthetic_runs[scenario], run)
    paths = make_report(run)
    names = sorted(p.name for p in paths)
    assert names == ["losses.png", "reward.png", "staleness.png", "summary.txt", "throughput.png",
                     "timeline.png"]
    for p in paths:
        assert p.parent == run / "report"
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data.startswith(PNG) and len(data) > 20_000, p  # a real, non-empty picture
    summary = (run / "report" / "summary.txt").read_text()
    assert f"bottleneck: {bottleneck}" in summary
    assert starved in summary
    for node in ("rollout", "reward", "actor"):
        assert re.search(rf"idle ratio {node}: \d+%", summary), summary
    suggestion = next(line for line in summary.splitlines() if line.startswith("suggestion:"))
    assert "give" in suggestion and bottleneck in suggestion


def test_report_reads_a_run_cut_short_by_a_crash(synthetic_runs, tmp_path):
    run = tmp_path / "crashed"
    shutil.copytree(synthetic_runs["rollout_bound"], run)
    rows = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(rows + '{"step": 31, "wall_')  # torn last row
    trace = (run / "trace.json").read_text().rstrip().rstrip("]")  # never closed
    (run / "trace.json").write_text(trace)
    assert len(load_rows(run / "metrics.jsonl")) == 30
    paths = make_report(run)
    assert "bottleneck: rollout" in paths[-1].read_text()


def test_report_covers_a_long_run_whose_older_rows_were_rotated_into_segments(synthetic_runs, tmp_path):
    from flowrl.segments import rotate, segments

    run = tmp_path / "long"
    shutil.copytree(synthetic_runs["rollout_bound"], run)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    for part in (lines[:12], lines[12:22]):  # as the hub does past rotate_bytes: gzip, start anew
        path.write_text("".join(part))
        rotate(path)
    path.write_text("".join(lines[22:]))
    assert len(segments(path)) == 2
    rows = load_rows(path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    summary = make_report(run)[-1].read_text()
    assert "steps 1..30 (30 rows)" in summary, summary


def test_report_of_a_directory_without_a_run_says_what_is_missing(tmp_path, capsys):
    with pytest.raises(ReportError, match="neither metrics.jsonl nor trace.json"):
        make_report(tmp_path)
    assert main(tmp_path) == 2
    assert "--run-dir" in capsys.readouterr().out


def test_overlapping_spans_of_one_process_count_once_work_first():
    from flowrl.metrics.analysis import exclusive_segments, node_utilisation

    spans = [{"ph": "X", "pid": 2, "tid": 7, "name": n, "ts": ts, "dur": d} for n, ts, d in (
        ("wait_input", 0, 10_000_000),   # the input task waits all 10 s ...
        ("compute", 2_000_000, 3_000_000),  # ... while the main task computes 3 s
        ("wait_credit", 5_000_000, 1_000_000),  # ... then waits 1 s to send
        ("compute", 8_000_000, 2_000_000))]
    assert exclusive_segments(spans) == [
        (0, 2_000_000, "wait_input"), (2_000_000, 5_000_000, "compute"),
        (5_000_000, 6_000_000, "wait_credit"), (6_000_000, 8_000_000, "wait_input"),
        (8_000_000, 10_000_000, "compute")]
    meta = {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "actor/0"}}
    use = node_utilisation([meta, *spans])["actor"]
    assert (use.busy, use.ratio("wait_input"), use.ratio("wait_credit")) == pytest.approx((0.5, 0.4, 0.1))
