"""benchmarks/checkpoint_stall.py: its figures from a known metrics.jsonl timeline."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import checkpoint_stall  # noqa: E402


def records(step_times: dict, saves: dict) -> list:
    """One training record per step (its step time); `saves`: save step -> (step it was reported at, stall)."""
    out = []
    for s, t in sorted(step_times.items()):
        r = {"step": s, "loss": 1.0, "step_time_s": t}
        for saved, (reported, stall) in saves.items():
            if reported == s:
                r.update({"checkpoint/step": saved, "checkpoint/stall_s": stall, "checkpoint/write_s": 3.0,
                          "checkpoint/gib": 2.0})
        out.append(r)
    return out


def test_summary_of_a_known_timeline():
    # 12 steps of 1 s; saves at 4 (stall 0.5 s, write in flight over steps 5-6, which take 1.5 s) and at 8
    # (stall 0.5 s, in flight over step 9, 1.5 s); the final save at 12 is not counted
    times = {s: 1.0 for s in range(1, 13)}
    times.update({5: 1.5, 6: 1.5, 9: 1.5})
    recs = records(times, {4: (6, 0.5), 8: (9, 0.5), 12: (12, 9.0)})
    r = checkpoint_stall.summarize(recs, steps=12, interval=4, warmup=1, at_interval=100)
    assert r["saves"] == 2 and r["stall_s"] == 0.5 and r["write_s"] == 3.0 and r["gib"] == 2.0
    assert r["clean_step_s"] == 1.0 and r["inflight_step_s"] == 1.5
    # window after save 4: steps 5-8 = 1.5 + 1.5 + 1 + 1 plus the 0.5 s stall -> 4 / 5.5
    assert r["window_ratio"] == pytest.approx(4 / 5.5)
    # per save: 0.5 s stall + (3 x 0.5 s extra over 2 saves) = 1.25 s per 100 clean steps
    assert r["overhead_at_100"] == pytest.approx(1.25 / 100)
    # the first save apart from the later ones: 0.5 s + 2 x 0.5 s extra; 0.5 s + 0.5 s extra
    assert r["first_overhead_at_100"] == pytest.approx(1.5 / 100)
    assert r["later_overhead_at_100"] == pytest.approx(1.0 / 100)
    assert r["first_inflight_step_s"] == r["later_inflight_step_s"] == 1.5
    assert r["later_window_ratio"] == pytest.approx(4 / (0.5 + 1.5 + 3))
    assert r["first_stall_s"] == r["later_stall_s"] == 0.5
    assert "nan" not in checkpoint_stall.format_table([{"gpus": 1, "mode": "async", "threads": 4, **r}], 100)


def test_no_save_is_an_error():
    with pytest.raises(ValueError, match="no save"):
        checkpoint_stall.summarize(records({s: 1.0 for s in range(1, 5)}, {}), 4, 2, 0, 100)
