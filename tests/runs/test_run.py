"""`streamrl run` end to end: real engine, rollout and learner processes on a tiny model."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import pytest
from run_helpers import check_accounting, start_run, step_records, streamrl_run, write_config

from streamrl.metrics import read_metrics

pytestmark = pytest.mark.slow


EVAL = """
[eval]
interval = 2
[[eval.datasets]]
name = "arith"
path = "builtin:arithmetic?n=6"
reward_fn = "tests.e2e_rewards:vowel_fraction"
[eval.datasets.sampling]
max_new_tokens = 8
temperature = 0.0
"""


def test_a_short_async_run_bounds_staleness_accounts_for_every_group_and_evaluates_while_training(
    tmp_path,
):
    """One run serves both: the training checks, and an eval data set whose eval records
    interleave with the steps (CI has 2 cores)."""
    config = write_config(tmp_path, steps=4, eta=1, extra=EVAL)
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = step_records(tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert record["staleness_max"] <= 1
        for key in (
            "reward_mean",
            "staleness_mean",
            "samples_trained",
            "groups_filtered",
            "groups_evicted",
            "learner_idle_s",
            "time",
            "weights/learner_stall_s",
        ):
            assert key in record
    assert steps[-1]["samples_trained"] == 4 * 2 * 4
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    check_accounting(summary)
    assert summary["groups_trained"] == 8
    assert summary["groups_duplicate"] == 0 and summary["bad_frames"] == 0
    assert (tmp_path / "out" / "checkpoints" / "step_000004" / "config.json").exists()
    _check_measured_memory(tmp_path / "out", summary)

    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    assert {r["version"] for r in evals} >= {0, 2}
    assert all(r["eval/arith/num_samples"] == 6 for r in evals)
    assert all(0.0 <= r["eval/arith/reward_mean"] <= 1.0 for r in evals)
    # Training went on: step records interleave with eval records.
    kinds = [r.get("kind", "step") for r in records]
    first_eval, last_step = kinds.index("eval"), len(kinds) - 1 - kinds[::-1].index("step")
    assert first_eval < last_step


def _check_measured_memory(out, summary) -> None:
    """The run measured each process's peak: host memory on the CPU, and no GPU figure (None,
    not a made-up number); `streamrl check --against` prints them next to the plan."""
    from streamrl.check import against_command
    from streamrl.config import load_config

    processes = summary["memory"]["processes"]
    assert set(processes) == {"learner rank 0", "engine 0"}
    for figures in processes.values():
        assert figures["host_peak_bytes"] > 50 * 2**20 and figures["pid"] > 0
        assert figures["gpu_peak_bytes"] is None and figures["measured_peak_bytes"] is None
    assert processes["learner rank 0"]["torch_max_allocated_bytes"] is None
    assert processes["engine 0"]["torch_max_reserved_bytes"] is None  # the engine's own report
    (record,) = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "memory"]
    assert record["memory/engine_0/host_peak_bytes"] == processes["engine 0"]["host_peak_bytes"]
    assert not any(key.endswith("gpu_peak_bytes") for key in record)
    cfg = load_config(out / "config.toml", [])
    assert against_command(cfg, out, json_path=str(out / "against.json")) == 0
    rows = json.loads((out / "against.json").read_text())["rows"]
    assert [row["process"] for row in rows] == ["learner rank 0", "engine 0"]
    assert all(row["measured_bytes"] is None and row["error"] is None for row in rows)


def test_weights_pushed_every_second_version_bound_staleness_and_the_last_version_lands(
    tmp_path,
):
    """weights.update_interval = 2 at max_staleness 1 (the largest interval it allows): every
    trained token comes from an even version (0, 2, 4: the only ones pushed during the run),
    no trained group is more than one version old, and the odd last version still reaches
    the engine when the run ends."""
    from streamrl.queues.rollout_files import ROLLOUTS_DIR, read_step, saved_steps

    extra = "[weights]\nupdate_interval = 2\n"
    config = write_config(tmp_path, steps=5, eta=1, extra=extra)
    train = "[train]\nsave_rollouts = true\nsave_final = false\n"  # (no final checkpoint)
    text = config.read_text().replace("[train]\n", train)
    config.write_text(text)
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    steps = step_records(out)
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 for r in steps)
    pushed = {r["weights/version"] for r in steps if "weights/version" in r}
    assert pushed <= {2, 4}, pushed  # a push lands in the records once the engine has it
    versions = set()
    for step in saved_steps(out / ROLLOUTS_DIR):
        for group in read_step(out / ROLLOUTS_DIR / f"step_{step:06d}.msgpack").groups:
            versions.update(int(v) for s in group.samples for v in s.model_versions)
    assert versions and versions <= {0, 2, 4}, versions
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and summary["groups_trained"] == 10
    assert set(summary["engine_versions"].values()) == {5}
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_async_with_staleness_and_no_correction_fails_fast_naming_the_options(tmp_path):
    config = write_config(tmp_path, extra='[algorithm]\noff_policy_correction = "none"\n')
    started = time.monotonic()
    result = streamrl_run(config, timeout=60)
    assert result.returncode == 2
    assert time.monotonic() - started < 30
    for option in ("algorithm.off_policy_correction", "buffer.max_staleness", "train.mode"):
        assert option in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_killed_run_resumes_from_its_checkpoint_without_repeating_trained_prompts(tmp_path):
    config = write_config(tmp_path, steps=6, eta=1, save_interval=2)
    out = tmp_path / "out"
    process = start_run(config)
    checkpoint = out / "checkpoints" / "step_000002" / "state.json"
    deadline = time.monotonic() + 240
    while not checkpoint.exists():  # readiness: the checkpoint is renamed into place when complete
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 240 s"
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    first = step_records(out)
    trained_before = {seq for r in first if r["step"] <= 2 for seq in r["prompt_seqs"]}
    # Stale checkpoints written after step 2 would make this test meaningless.
    state = json.loads(checkpoint.read_text())
    assert state["version"] == 2

    result = streamrl_run(config, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    records = step_records(out)
    resumed = records[len(first) :]
    assert resumed[0]["step"] == 3 and resumed[0]["version"] == 3
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    trained_after = {seq for r in resumed for seq in r["prompt_seqs"]}
    assert not trained_before & trained_after
    # No orphans: the killed run's engine and rollout died with it.
    processes = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert [line for line in processes.splitlines() if str(tmp_path) in line] == []


def test_streamrl_run_trains_a_policy_and_gae_critic_with_the_megatron_backend_at_tp_2(tmp_path):
    """The follower rank makes the critic's calls too (announced by rank 0), and the final
    checkpoint holds the critic beside the policy."""
    config = write_config(
        tmp_path, steps=3, eta=1, extra='[algorithm]\nadvantage_estimator = "gae"\n',
        megatron="tensor_parallel_size = 2",
    )  # fmt: skip
    result = streamrl_run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    steps = step_records(out)
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 and r["train/critic_grad_norm"] > 0 for r in steps)
    assert all(math.isfinite(r["train/critic_explained_variance"]) for r in steps)
    # The second rank ran as its own process and exited cleanly with the run.
    assert (out / "logs" / "learner-rank1.log").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and set(summary["engine_versions"].values()) == {3}
    final = out / "checkpoints" / "step_000003"
    assert (final / "model.safetensors").exists()
    assert (final / "critic" / "model.safetensors").exists()


def test_ctrl_c_stops_every_process_with_a_clear_message(tmp_path):
    config = write_config(tmp_path, steps=50, eta=1)
    out = tmp_path / "out"
    process = start_run(config)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no step after 240 s"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=60)
    stderr = process.stderr.read()
    assert code == 130, stderr[-3000:]
    assert "interrupted; every process stopped" in stderr
    # What the run measured until then stays: its steps, why it stopped, its memory peaks.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 1 and summary["error"].startswith("interrupted"), summary
    assert "learner rank 0" in summary["memory"]["processes"], summary["memory"]
    processes = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert [line for line in processes.splitlines() if str(tmp_path) in line] == []


def test_streamrl_run_at_pipeline_parallel_2_leaves_the_engine_with_the_final_weights(
    tmp_path, tiny_model_dir
):
    """Each stage broadcasts its own layers: the attached engine, still running after the run,
    scores fixed tokens exactly like the final checkpoint, and unlike stage 0's half of it."""
    import httpx
    from engine_helpers import running_engines, teacher_forced_logprobs
    from safetensors.torch import load_file

    prompt = [1, 504, 3458, 314, 253, 1380, 30, 2]
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    logs = tmp_path / "engine-logs"
    with running_engines(tiny_model_dir, logs, extra_args=["--weight-version", "0"]) as engines:
        url = engines[0].url
        config = write_config(tmp_path, steps=3, eta=1, megatron="pipeline_parallel_size = 2")
        text = config.read_text().replace('"random:qwen3-tiny"', f'"{tiny_model_dir}"')
        text = text.replace("[engine]\n", f'[engine]\nurls = ["{url}"]\n')
        config.write_text(text)
        result = streamrl_run(config)
        assert result.returncode == 0, result.stderr[-3000:]
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        answer = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        version = httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"]

    out = tmp_path / "out"
    steps = step_records(out)
    assert [r["version"] for r in steps] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting_ok"] and set(summary["engine_versions"].values()) == {3}
    assert version == "3" and answer["meta_info"]["weight_version"] == "3"
    assert (out / "logs" / "learner-rank1.log").exists()

    engine_logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    output_ids = answer["output_ids"]
    final = out / "checkpoints" / "step_000003"
    expected = teacher_forced_logprobs(str(final), prompt, output_ids)
    assert max(abs(a - b) for a, b in zip(engine_logprobs, expected, strict=True)) <= 1e-4
    stage0_only = load_file(final / "model-00001-of-00002.safetensors")
    half = teacher_forced_logprobs(tiny_model_dir, prompt, output_ids, stage0_only)
    assert max(abs(a - b) for a, b in zip(engine_logprobs, half, strict=True)) > 1e-3
