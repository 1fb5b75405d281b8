"""`streamrl bench pause` against a real embedded engine: each mode measured, written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_pause_bench_measures_each_mode_and_counts_what_abort_resends(tiny_engine, tmp_path):
    out = tmp_path / "pause.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "streamrl", "bench", "pause", "--url", tiny_engine.url,
            "--modes", "in_place,abort,retract_abort", "--requests", "3", "--prompt-tokens", "4",
            "--max-new-tokens", "200", "--updates", "2", "--interval-s", "0.2",
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["result"]["modes"]
    assert set(rows) == {"in_place", "abort", "retract_abort"}
    assert out.with_suffix(".png").exists()
    for row in rows.values():
        assert row["num_samples"] == 3 and row["generated_tokens"] == 3 * 200
        assert len(row["pause_s_all"]) == 2 and row["inexact_samples"] == 0  # spans: exact
    assert rows["in_place"]["resume_prompt_tokens"] == 0
    # Every request still decoding at an abort comes back and is sent again, partial output
    # included: at least the prompts of the first update's three requests.
    for mode in ("abort", "retract_abort"):
        assert rows[mode]["resumes"] >= 3 and rows[mode]["resume_prompt_tokens"] > 3 * 4
