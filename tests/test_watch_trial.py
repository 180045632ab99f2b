"""bench/watch_trial.py's reading of the watch's timeline: the windows judged, the first alarm with the
requests and seconds to it, the windows below the band, and how a restart at another k was seen. The trial
itself runs real vLLM servers for an hour and more (docs/watch.md#the-trial)."""

from bench.watch_trial import below_band, first_alarm, judged, read_timeline, restart_seen


def window(t, verdict, length, high, requests=10, low_edge=1.30, k=2):
    return {
        "time": t, "verdict": verdict, "reason": verdict, "mean_acceptance_length": length,
        "acceptance_low": length - 0.05, "acceptance_high": high, "expected_low": low_edge,
        "requests": requests, "seconds": 60.0, "per_position": [0.3] * k, "actions": [verdict],
    }  # fmt: skip


def test_first_alarm_and_windows_below_the_band():
    records = [
        window(100, "net-negative", 1.38, 1.42),  # slower than the baseline, as eval measured: not below
        {"time": 130, "verdict": "insufficient", "reason": "", "acceptance_low": 1.0, "window_open": True},
        window(160, "net-negative", 1.35, 1.41, requests=12),
        window(220, "net-negative", 1.04, 1.07, requests=9),  # the upgrade: below the band
        window(280, "net-negative", 1.03, 1.06),
    ]
    assert len(judged(records)) == 4  # the window still growing is not one
    assert [below_band(r) for r in judged(records)] == [False, False, True, True]
    first = first_alarm(records, below_band, started_s=40.0)
    assert first["window"] == 3 and first["requests_since_switch"] == 10 + 12 + 9
    assert first["seconds_since_switch"] == 180.0 and first["actions"] == ["net-negative"]
    assert first_alarm(records, lambda r: r["verdict"] == "healthy", 40.0) is None


def test_a_restart_at_another_k_seen_on_the_first_answer():
    records = [
        window(100, "healthy", 1.38, 1.42),
        {"time": 131, "verdict": "down", "reason": "no answer"},
        {"time": 170.4, "verdict": "restarted", "reason": "the server answers again after 39 s down", "k": 3},
        window(230, "healthy", 1.45, 1.52, k=3),
        window(290, "degraded", 1.20, 1.25, k=3),
    ]
    seen = restart_seen(records, stopped_s=130.0, answered_s=170.0, k=3)
    assert seen["seen"] and seen["seen_k"] == 3 and seen["seen_after_answer_s"] == 0.4
    assert seen["down_s"] == 40.0 and seen["down_records"] == 1
    assert seen["windows_after"] == 2 and seen["verdicts_after"] == {"healthy": 1, "degraded": 1}
    assert seen["below_band_after"] == 1
    # a restart the watch never reported
    unseen = restart_seen(records[:2], stopped_s=130.0, answered_s=170.0, k=3)
    assert not unseen["seen"] and unseen["seen_k"] is None and unseen["windows_after"] == 0


def test_the_timeline_as_it_grows(tmp_path):
    path = tmp_path / "timeline.jsonl"
    assert read_timeline(path) == []
    path.write_text('{"time": 1, "verdict": "healthy"}\n{"time": 2, "verd')  # a line still being written
    assert read_timeline(path) == [{"time": 1, "verdict": "healthy"}]
