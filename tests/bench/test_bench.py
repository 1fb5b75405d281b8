"""`streamrl bench`: the engine's busy clock, window arithmetic, recording, plots, and smokes.

Fast tests use fakes and one tiny engine; the end-to-end smokes of `staleness` and
`sync-vs-async` start whole runs and are marked slow.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from engine_helpers import engine_load, running_engines

from streamrl.actors.auto_staleness import Reason
from streamrl.agents import synthetic
from streamrl.bench import phases, runs, staleness, sync_async
from streamrl.bench.load import ClientProcesses, prompts_for
from streamrl.bench.results import write_result
from streamrl.bench.runs import EngineReading
from streamrl.process import free_port
from streamrl.types import Group, Sample

REPO = Path(__file__).parents[2]


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "bench", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


# ---------------------------------------------------------------- engine busy clock


def test_get_load_reports_a_busy_clock_and_the_tokens_the_engine_generated(
    tiny_model_dir, tmp_path
):
    with running_engines(tiny_model_dir, tmp_path) as (engine,):
        idle = engine_load(engine.url)
        assert idle["busy_s"] == 0.0 and idle["generated_tokens"] == 0
        body = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 16,
                "ignore_eos": True}}  # fmt: skip
        outputs = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()
        after = engine_load(engine.url)
    generated = sum(out["meta_info"]["completion_tokens"] for out in outputs)
    assert after["generated_tokens"] == generated == 32
    assert 0.0 < after["busy_s"] < after["uptime_s"]
    assert after["uptime_s"] > idle["uptime_s"]


def test_client_processes_deal_a_round_out_and_gather_every_answer(tiny_engine):
    """Five requests from two client processes (three and two of them), two streamed: every
    answer comes back and the wall time covers them all; a round that fails in a process
    fails in the bench, and one given up on leaves nothing behind: the next round gets its
    own answers."""
    prompts = prompts_for(5, 8, seed=0, vocab_size=100)
    with ClientProcesses(2) as clients:
        measured = asyncio.run(
            clients.measure(tiny_engine.url, prompts, max_new_tokens=4, num_probes=2)
        )
        assert measured["requests"] == 5 and measured["num_errors"] == 0
        assert measured["generated_tokens"] == 20 and measured["num_short"] == 0
        assert measured["num_without_logprobs"] == 0 and len(measured["ttft_s_all"]) == 2
        assert 0 < measured["latency_s_max"] <= measured["wall_s"]
        with pytest.raises(RuntimeError, match="client process failed"):  # nothing listens
            asyncio.run(clients.measure(f"http://127.0.0.1:{free_port()}", prompts[:2],
                                        max_new_tokens=4, num_probes=0))  # fmt: skip
        with pytest.raises(TimeoutError):  # a round given up on: its answers come later
            asyncio.run(asyncio.wait_for(clients.measure(tiny_engine.url, prompts,
                                         max_new_tokens=64, num_probes=0), 0.05))  # fmt: skip
        again = asyncio.run(
            clients.measure(tiny_engine.url, prompts[:3], max_new_tokens=2, num_probes=0)
        )
    assert again["generated_tokens"] == 6 and again["num_errors"] == 0


def test_a_client_process_reply_to_an_earlier_round_is_not_taken_for_this_ones():
    """A reply left on a pipe by a round the bench gave up on (its reading thread never ran)
    is dropped by the next round, which reads on to its own."""
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    theirs.send((1, RuntimeError("round 1 failed")))
    theirs.send((2, ([{"tokens": 3}], 0.25)))
    assert ClientProcesses._reply(ours, 2) == ([{"tokens": 3}], 0.25)
    theirs.send((3, ValueError("refused")))
    with pytest.raises(RuntimeError, match="client process failed: ValueError"):
        ClientProcesses._reply(ours, 3)


# ---------------------------------------------------------------- window arithmetic


def _fake_run(run_dir: Path, *, num_steps: int = 4, step_s: float = 2.0) -> None:
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as handle:
        for step in range(1, num_steps + 1):
            record = {
                "step": step, "version": step, "reward_mean": 0.1 * step, "staleness_mean": 1.0,
                "samples_trained": 16 * step, "learner_idle_s": 0.5, "train_s": 1.5,
                "time": 5.0 + step_s * step, "train/trained_tokens": 100.0,
                "weights/learner_stall_s": 0.01, "weights/engine_pause_s": 0.02,
                "weights/broadcast_s": 0.01, "weights/gb_per_s": 1.0,
            }  # fmt: skip
            handle.write(json.dumps(record) + "\n")
        evaluation = {"kind": "eval", "dataset": "capitals", "step": 2, "version": 2, "time": 9.5,
                      "eval/capitals/reward_mean": 0.5, "eval/capitals/pass_at_1": 0.5}  # fmt: skip
        handle.write(json.dumps(evaluation) + "\n")
    summary = {
        "groups_started": 20, "groups_trained": 16, "groups_filtered": 0, "groups_evicted": 0,
        "accounting_ok": True,
        "buffer": {"staleness_histogram": {"0": 4, "1": 12}, "versions_spanned_histogram": {}},
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_the_window_leaves_out_the_first_step_and_uses_the_learner_clock(tmp_path):
    _fake_run(tmp_path / "run")
    readings = [
        EngineReading(0, 0.0, [0.0], [10.0], [0]),
        EngineReading(1, 1.0, [1.0], [17.0], [400]),
        EngineReading(4, 2.0, [4.0], [23.0], [1000]),
    ]
    result = runs.summarize(tmp_path / "run", readings)
    assert result["warmup_steps"] == 1
    assert result["window_s"] == pytest.approx(6.0)  # end of step 1 to end of step 4
    assert result["trained_tokens"] == 300.0
    assert result["effective_tokens_per_s"] == pytest.approx(50.0)
    assert result["samples_per_s"] == pytest.approx(48 / 6.0)
    assert result["learner_idle_frac"] == pytest.approx(1.5 / 6.0)
    assert result["engine_idle_frac"] == pytest.approx(1.0 - 3.0 / 6.0)
    assert result["generated_tokens_per_s"] == pytest.approx(600 / 6.0)
    assert [p["reward_mean"] for p in result["reward_curve"]] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert result["evals"] == [{"version": 2, "time_s": 9.5, "capitals": 0.5}]


def test_engine_figures_are_absent_rather_than_wrong_when_readings_are_missing(tmp_path):
    _fake_run(tmp_path / "run")
    result = runs.summarize(tmp_path / "run", [])
    assert result["engine_idle_frac"] is None and result["generated_tokens_per_s"] is None


def test_final_reward_averages_the_last_quarter_of_steps():
    curve = [{"reward_mean": float(value)} for value in range(8)]
    assert staleness.final_reward(curve) == pytest.approx(6.5)
    assert staleness.final_reward(curve, fraction=1.0) == pytest.approx(3.5)


# ---------------------------------------------------------------- recording and replay


def _group(index: int, num_tokens: int = 5) -> Group:
    sample = Sample(
        prompt_ids=[1, 2, 3], response_ids=np.arange(num_tokens), logprobs=-np.ones(num_tokens),
        versions=np.zeros(num_tokens), loss_mask=np.ones(num_tokens), reward=float(index),
    )  # fmt: skip
    return Group(group_id=f"g{index}", prompt_seq=index, prompt_index=index, samples=[sample])


def test_recorded_batches_come_back_in_training_order(tmp_path, monkeypatch):
    import streamrl.actors.learner as learner_module

    calls = []
    monkeypatch.setattr(
        learner_module, "train_step", lambda backend, groups, cfg, *, pad_id: calls.append(groups)
    )
    path = tmp_path / "groups.msgpack"
    with runs.record_trained_groups(path):
        learner_module.train_step(None, [_group(0), _group(1)], None, pad_id=0)
        learner_module.train_step(None, [_group(2)], None, pad_id=0)
    assert len(calls) == 2  # the real step still ran
    batches = runs.read_recorded_groups(path)
    assert [[g.group_id for g in batch] for batch in batches] == [["g0", "g1"], ["g2"]]
    assert batches[1][0].samples[0].reward == 2.0
    assert np.array_equal(batches[0][0].samples[0].response_ids, np.arange(5))


def test_training_alone_replays_recorded_batches_through_train_step(
    tmp_path, tiny_model_dir, monkeypatch
):
    import streamrl.actors.learner as learner_module
    from streamrl.config import config_from_dict

    monkeypatch.setattr(learner_module, "train_step", lambda *args, **kwargs: None)
    path = tmp_path / "groups.msgpack"
    with runs.record_trained_groups(path):
        for index in range(2):
            group = _group(2 * index)
            group.samples.append(_group(2 * index + 1).samples[0])  # two rewards: an advantage
            learner_module.train_step(None, [group], None, pad_id=0)
    cfg = config_from_dict({"data": {"path": "x"}, "model": {"path": tiny_model_dir},
                            "rollout": {"batch_size": 1, "n_samples_per_prompt": 2},
                            "learner": {"lr": 1e-3, "num_threads": 1}})  # fmt: skip
    result = phases.replay(cfg, model_path=tiny_model_dir, groups_path=path)
    assert result["batches"] == 2 and result["batches_timed"] == 1
    assert result["trained_tokens_per_s"] > 0
    start, end = result["window_monotonic"]  # the timed batch, on the GPU monitor's clock
    assert end - start >= result["train_s"][1] > 0


# ---------------------------------------------------------------- configs and rewards


@pytest.mark.parametrize("path", sorted(REPO.glob("bench/configs/*.toml")), ids=lambda p: p.name)
def test_every_bench_config_loads_and_trains_every_generated_group(path):
    from streamrl.config import load_config

    cfg = load_config(path)
    assert cfg.rollout.generate_fn == "streamrl.agents.synthetic:generate_scored"
    assert cfg.buffer.filters == []  # throughput must not depend on what the policy learned


def test_the_gpu_driver_names_configs_that_exist():
    script = (REPO / "bench/gpu/run_benches.sh").read_text()
    for name in ("gpu_2gpu", "gpu_1gpu", "cpu_tiny"):
        assert name in script and (REPO / f"bench/configs/{name}.toml").exists()
    for path in sorted((REPO / "bench/gpu").glob("*.sh")):
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, (path.name, check.stderr)


def test_gguf_parts_carried_in_separate_calls_join_only_when_all_arrived(tmp_path):
    # The GPU scripts carry SmolLM2's GGUF in parts, one or two per call, and join them on
    # the last: here a stand-in file in three parts, each in its own "call" directory.
    whole = bytes(range(256)) * 1000
    for index, (start, end) in enumerate([(0, 100_000), (100_000, 200_000), (200_000, None)]):
        (tmp_path / f"call{index}/.gguf").mkdir(parents=True)
        (tmp_path / f"call{index}/.gguf/part.a{'abc'[index]}").write_bytes(whole[start:end])

    def join_after(calls: list[int]) -> subprocess.CompletedProcess:
        setup = (
            f"source {REPO}/bench/gpu/gguf_parts.sh && GGUF_STASH={tmp_path}/stash/smollm2 "
            f"GGUF_DIR={tmp_path}/joined GGUF_FILE={tmp_path}/joined/model.gguf "
            f"GGUF_SHA256={hashlib.sha256(whole).hexdigest()} && mkdir -p {tmp_path}/stash"
        )
        stashes = [f"(cd {tmp_path}/call{i} && gguf_stash >/dev/null)" for i in calls[:-1]]
        last = f"cd {tmp_path}/call{calls[-1]} && gguf_join"
        script = " && ".join([setup, *stashes, last])
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True)

    missing = join_after([0, 2])
    assert missing.returncode == 1 and "a part is missing" in missing.stderr
    joined = join_after([0, 1, 2])
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "joined/model.gguf").read_bytes() == whole


def test_a_bad_override_is_an_error_line_naming_the_key_not_a_traceback(tmp_path):
    result = _bench("staleness", "configs/quickstart.toml", "--set", "buffer.nope=1",
                    "--work-dir", str(tmp_path), timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "error: configs/quickstart.toml: buffer.nope: unknown key" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing started


def test_synthetic_rewards_read_tokens_and_logprobs_only():
    assert synthetic.confidence_reward([-1.0, -3.0]) == -2.0
    assert synthetic.confidence_reward([]) == 0.0
    assert synthetic.repeat_reward([5, 5, 5, 7]) == pytest.approx(2 / 4)
    assert synthetic.repeat_reward([]) == 0.0
    assert synthetic.token_mod_reward([8, 16, 3], modulus=8, max_new_tokens=4) == pytest.approx(0.5)


# ---------------------------------------------------------------- plots


def _staleness_result(*, seeds=(None,), auto=False) -> dict:
    def run(eta, correction: str, seed) -> dict:
        bound = 2 if eta == "auto" else eta
        return {
            "name": staleness.run_name(eta, correction, seed), "eta": eta,
            "correction": correction, "seed": seed,
            "effective_tokens_per_s": 100.0 + bound + (seed or 0), "samples_per_s": 5.0,
            "generated_tokens_per_s": 120.0, "learner_idle_frac": 0.2, "engine_idle_frac": 0.5,
            "final_reward": 0.3 + 0.01 * (seed or 0), "mean_reward": 0.2,
            "staleness_histogram": {"0": 1, str(bound): 3},
            "reward_curve": [{"step": s, "samples_trained": 16 * s, "reward_mean": 0.1 * s,
                              "time_s": 2.0 * s, "mismatch_kl": 0.001 * s,
                              "importance_ess": 1.0 - 0.01 * s, "bound": bound,
                              "auto_change": 1 if eta == "auto" and s == 2 else 0}
                             for s in range(1, 4)],
            "evals": [{"version": 0, "time_s": 1.0, "multistep": 0.1},
                      {"version": 3, "time_s": 7.0, "multistep": 0.2 + bound / 100}],
        }  # fmt: skip

    settings = [(0, "decoupled_ppo"), (2, "decoupled_ppo"), (2, "none")]
    settings += [("auto", "decoupled_ppo")] if auto else []
    runs = [run(eta, c, seed) for seed in seeds for eta, c in settings]
    return staleness.summarize_sweep(runs)


def test_auto_is_also_compared_with_the_fastest_fixed_eta_that_learns_as_eta_0_does():
    # eta 4 is the fastest but its final reward is 5% below eta 0's; eta 2 is 1% below.
    def run(eta, tokens_per_s: float, reward: float, evals=((0, 0.5), (20, 0.8)),
            samples_per_s=1.0) -> dict:  # fmt: skip
        return {"name": staleness.run_name(eta, "decoupled_ppo", 0), "eta": eta,
                "correction": "decoupled_ppo", "seed": 0, "effective_tokens_per_s": tokens_per_s,
                "samples_per_s": samples_per_s, "final_reward": reward, "mean_reward": reward,
                "reward_curve": [], "evals": [{"version": v, "time_s": 0.0, "capitals": r}
                                              for v, r in evals]}  # fmt: skip

    result = staleness.summarize_sweep([
        run(0, 100.0, 0.80), run(2, 150.0, 0.792, samples_per_s=1.5), run(4, 200.0, 0.76),
        run("auto", 145.0, 0.80, evals=((0, 0.5), (20, 0.84), (30, 0.9)), samples_per_s=1.2),
    ])  # fmt: skip
    assert result["best_fixed_eta"] == 4 and result["best_fixed_eta_within_reward"] == 2
    auto = next(s for s in result["settings"] if s["eta"] == "auto")
    assert auto["tokens_per_s_vs_best_fixed"] == pytest.approx(145 / 200 - 1)
    assert auto["tokens_per_s_vs_best_fixed_within_reward"] == pytest.approx(145 / 150 - 1)
    # eta 4's tokens came from longer answers; eta 2 trained the most samples per second.
    assert auto["samples_per_s_vs_best_fixed"] == pytest.approx(1.2 / 1.5 - 1)
    # Evaluations are compared at the versions both have.
    assert list(auto["eval_by_version"]) == ["0", "20", "30"]
    assert auto["eval_vs_eta0"] == pytest.approx({"0": 0.0, "20": 0.84 / 0.8 - 1})


def test_a_sweep_is_summarised_per_setting_over_its_seeds():
    result = _staleness_result(seeds=(0, 1, 2), auto=True)
    settings = {(s["eta"], s["correction"]): s for s in result["settings"]}
    assert list(settings) == [(0, "decoupled_ppo"), (2, "decoupled_ppo"),
                              ("auto", "decoupled_ppo"), (2, "none")]  # fmt: skip
    zero, auto = settings[(0, "decoupled_ppo")], settings[("auto", "decoupled_ppo")]
    assert zero["seeds"] == [0, 1, 2]
    assert zero["final_reward"] == pytest.approx(
        {"mean": 0.31, "min": 0.30, "max": 0.32, "std": (2 / 3) ** 0.5 * 0.01}
    )
    assert zero["final_reward_vs_eta0"] == 0.0
    assert result["best_fixed_eta"] == 2 and result["baseline"] == pytest.approx(101.0)
    assert auto["tokens_per_s_vs_best_fixed"] == pytest.approx(0.0)
    assert zero["tokens_per_s_vs_best_fixed"] == pytest.approx(101 / 103 - 1)
    assert auto["eval_first"]["mean"] == pytest.approx(0.1)
    assert auto["eval_last"]["mean"] == pytest.approx(0.22)
    assert auto["auto_bound"]["max"] == 2
    assert auto["eval_by_version"]["3"]["mean"] == pytest.approx(0.22)
    assert auto["eval_vs_eta0"] == pytest.approx({"0": 0.0, "3": 0.22 / 0.2 - 1})
    assert staleness.parse_etas("0, 2,auto") == [0, 2, "auto"]
    with pytest.raises(ValueError, match="'x' is neither"):
        staleness.parse_etas("0,x")


def test_staleness_and_sync_async_results_are_written_with_their_plots(tmp_path):
    path = write_result(tmp_path / "s.json", bench="staleness", config={},
                        result=_staleness_result(seeds=range(6), auto=True),
                        plot=staleness.plot_staleness, num_panels=staleness.NUM_PANELS)  # fmt: skip
    assert path.with_suffix(".png").stat().st_size > 10_000
    record = json.loads(path.read_text())
    assert record["bench"] == "staleness" and "commit" in record and "machine" in record
    on_gpus = _staleness_result()
    for run in on_gpus["runs"]:
        run["gpu_busy"] = {"0": 0.9}  # a third bar beside the idle shares
    path = write_result(tmp_path / "g.json", bench="staleness", config={}, result=on_gpus,
                        plot=staleness.plot_staleness, num_panels=staleness.NUM_PANELS)  # fmt: skip
    assert path.with_suffix(".png").stat().st_size > 10_000
    run = {"effective_tokens_per_s": 90.0, "learner_idle_frac": 0.1, "learner_train_frac": 0.8,
           "engine_idle_frac": 0.3, "gpu_busy": {"0": 0.95}}  # fmt: skip
    result = {"eta": 1, "runs": {"async": run, "sync": run}, "speedup": 1.0,
              "generation_alone": {"trainable_tokens_per_s": 150.0},
              "training_alone": {"trained_tokens_per_s": 100.0},
              "bottleneck_tokens_per_s": 100.0, "pipeline_efficiency": 0.9,
              "ideal_sync_tokens_per_s": 60.0, "shared_gpu_bound_tokens_per_s": 70.0}  # fmt: skip
    path = write_result(tmp_path / "a.json", bench="sync-vs-async", config={}, result=result,
                        plot=sync_async.plot_sync_async, num_panels=2)  # fmt: skip
    assert path.with_suffix(".png").exists()
    partial = {"eta": 1, "runs": {"async": run}, "speedup": None}  # a part cut short
    path = write_result(tmp_path / "p.json", bench="sync-vs-async", config={}, result=partial,
                        plot=sync_async.plot_sync_async, num_panels=2)  # fmt: skip
    assert path.with_suffix(".png").exists()


def test_merge_joins_staleness_parts_and_a_later_file_wins(tmp_path):
    first, second = _staleness_result(), _staleness_result()
    second["runs"] = [dict(second["runs"][1], effective_tokens_per_s=999.0)]
    second["runs"].append(dict(second["runs"][0], name="eta8-decoupled_ppo", eta=8))
    paths = []
    for index, result in enumerate((first, second)):
        paths.append(write_result(tmp_path / f"part{index}.json", bench="staleness",
                                  config={"corrections": ["decoupled_ppo", "none"]},
                                  result=result))  # fmt: skip
    out = tmp_path / "merged.json"
    inputs = [str(p) for p in paths]
    code = staleness.merge_command(argparse.Namespace(inputs=inputs, json=out, pool=False, eta=""))
    assert code == 0
    merged = json.loads(out.read_text())
    names = [r["name"] for r in merged["result"]["runs"]]
    assert names == ["eta0-decoupled_ppo", "eta2-decoupled_ppo", "eta8-decoupled_ppo", "eta2-none"]
    assert merged["result"]["runs"][1]["effective_tokens_per_s"] == 999.0
    assert len(merged["config"]["merged_from"]) == 2
    assert out.with_suffix(".png").exists()


def test_merge_pools_runs_that_repeat_a_seed_and_keeps_only_the_etas_asked_for(tmp_path):
    """`--pool`: two parts with the same seeds make two runs per setting and seed, and each
    setting's spread is over both; `--eta` leaves the other settings out."""
    first, second = _staleness_result(), _staleness_result()
    second["runs"] = [dict(run, effective_tokens_per_s=run["effective_tokens_per_s"] + 100.0)
                      for run in second["runs"]]  # fmt: skip
    paths = [write_result(tmp_path / f"part{index}.json", bench="staleness",
                          config={"corrections": ["decoupled_ppo", "none"]}, result=result)
             for index, result in enumerate((first, second))]  # fmt: skip
    out = tmp_path / "pooled.json"
    args = argparse.Namespace(inputs=[str(p) for p in paths], json=out, pool=True, eta="0,2")
    assert staleness.merge_command(args) == 0
    result = json.loads(out.read_text())["result"]
    names = sorted(r["name"] for r in result["runs"])
    kept = sorted(r["name"] for r in first["runs"] if r["eta"] in (0, 2))
    assert names == sorted([*kept, *(f"{name}@part1" for name in kept)])
    for setting in result["settings"]:
        low = min(r["effective_tokens_per_s"] for r in first["runs"]
                  if (r["eta"], r["correction"]) == (setting["eta"], setting["correction"]))  # fmt: skip
        assert setting["effective_tokens_per_s"]["min"] == low
        assert setting["effective_tokens_per_s"]["max"] == low + 100.0
    bad = argparse.Namespace(inputs=[str(paths[0])], json=out, pool=False, eta="0,x")
    assert staleness.merge_command(bad) == 2
    none_left = argparse.Namespace(inputs=[str(paths[0])], json=out, pool=False, eta="7")
    assert staleness.merge_command(none_left) == 2


# ---------------------------------------------------------------- command smokes


def test_collective_measures_two_gloo_ranks(tmp_path):
    result = _bench("collective", "--sizes-mb", "1", "--iterations", "2",
                    "--json", str(tmp_path / "c.json"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "peak broadcast" in result.stdout
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["result"]["runs"][0]["sizes"][0]["broadcast_gib_per_s"] > 0
    assert (tmp_path / "c.png").exists()


def test_weight_sync_publishes_full_weights_and_lora_adapters_to_a_real_engine_with_their_cost(
    tmp_path,
):
    """One bench run (one engine start) measures both: rank 0 (the full weights) and rank 4
    (adapters that the engine merges)."""
    result = _bench("weight-sync", "--shape", "qwen3-tiny", "--engines", "1", "--repeats", "1",
                    "--lora-rank", "0,4", "--work-dir", str(tmp_path / "work"),
                    "--json", str(tmp_path / "w.json"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "w.json").read_text())["result"]
    full, lora = record["engines"]
    assert (full["lora_rank"], lora["lora_rank"]) == (0, 4)
    assert full["num_engines"] == 1 and len(full["samples"]) == 2
    assert full["gb_per_s_mean"] > 0 and full["engine_pause_s_mean"] >= full["broadcast_s_mean"]
    assert full["bytes"] == record["setup"]["bytes"] and 0 < lora["bytes"] < full["bytes"] / 4
    assert lora["num_tensors"] == 2 * 7 * 2  # A and B of 7 linears in each of 2 layers
    assert lora["gb_per_s_mean"] > 0 and "rank 4" in result.stdout
    assert (tmp_path / "w.png").exists()


def test_engine_bench_measures_the_embedded_engine_over_http_and_in_process(tmp_path):
    out = tmp_path / "e.json"
    result = _bench("engine", "--device", "cpu", "--dtype", "float32", "--shape", "qwen3-tiny",
                    "--requests", "2,6", "--prompt-tokens", "16", "--max-new-tokens", "8",
                    "--repeats", "3", "--warmup-rounds", "1", "--ttft-probes", "2",
                    "--work-dir", str(tmp_path / "work"), "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["config"]["device"] == "cpu" and record["config"]["requests"] == [2, 6]
    assert record["config"]["max_new_tokens"] == 8 and record["machine"]
    engines = record["result"]["engines"]
    if "sglang" not in engines:
        assert "import sglang" in record["result"]["skipped"]["sglang"]
    assert "--max-batch-size" in engines["embedded"]["argv"]
    for name in ("embedded", "in-process"):
        for count in (2, 6):
            cell = engines[name]["counts"][str(count)]
            measured = cell["median_round"]
            assert cell["tokens_per_s"] > 0, (name, count)
            rates = cell["tokens_per_s_all"]
            assert len(rates) == 3 and cell["tokens_per_s"] == sorted(rates)[1]
            assert cell["tokens_per_s_min"] <= cell["tokens_per_s"] <= cell["tokens_per_s_max"]
            assert cell["first_over_last"] == pytest.approx(rates[0] / rates[-1])
            assert cell["steady"] == (abs(rates[0] / rates[-1] - 1) <= 0.05)
            assert measured["generated_tokens"] == count * 8 and measured["num_errors"] == 0
            assert measured["num_short"] == 0 and measured["num_without_logprobs"] == 0
    for count in (2, 6):
        for name in ("embedded", "in-process"):  # 2 probes each: streamed / a token callback
            cell = engines[name]["counts"][str(count)]
            assert len(cell["median_round"]["ttft_s_all"]) == 2, name
            assert 0 < cell["ttft_s_median"] <= cell["median_round"]["latency_s_max"], name
        for name in ("embedded", "in-process"):  # the engine's own counters
            measured = engines[name]["counts"][str(count)]["median_round"]
            assert measured["engine_generated_tokens"] == count * 8, name
            assert measured["engine_decode_steps"] >= 7 and measured["engine_prefills"] >= 1
            assert measured["engine_busy_share"] > 0, name  # (whole steps: it may pass 1)
    ratio = record["result"]["ratios"]["embedded_over_in-process"]
    assert set(ratio) == {"2", "6"} and all(value > 0 for value in ratio.values())
    assert (tmp_path / "e.png").stat().st_size > 0


SMOKE_SETS = ["--set", "rollout.batch_size=2", "--set", "rollout.sampling.max_new_tokens=8"]


AUTO_SETS = ["--set", "buffer.auto.start=0", "--set", "buffer.auto.window_steps=1",
             "--set", "buffer.auto.raise_idle_share=0.0"]  # fmt: skip
"""An auto bound that decides on every step and raises whenever the learner waited at all."""


@pytest.mark.slow
def test_staleness_runs_each_eta_in_its_own_directory_and_reports_throughput(tmp_path):
    """eta 0 and `auto` (started at 0, deciding every step): the auto run's learner waits at
    bound 0, so the bound goes up at its first decision (step 2, after the fill) and every
    trained group keeps the bound in force when it was admitted."""
    result = _bench("staleness", "bench/configs/cpu_tiny.toml", "--eta", "0,auto", "--steps", "5",
                    *SMOKE_SETS, *AUTO_SETS, "--tag", "v", "--work-dir", str(tmp_path / "work"),
                    "--json", str(tmp_path / "s.json"), timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((tmp_path / "s.json").read_text())["result"]
    runs_ = out["runs"]
    assert [r["eta"] for r in runs_] == [0, "auto"]
    # The tag names the variant apart from the plain setting.
    assert [r["name"] for r in runs_] == ["eta0-decoupled_ppo+v", "etaauto-decoupled_ppo+v"]
    assert {r["correction"] for r in runs_} == {"decoupled_ppo+v"}
    for run in runs_:
        assert (tmp_path / "work" / run["name"] / "summary.json").exists()
        assert run["effective_tokens_per_s"] > 0 and run["accounting_ok"]
        assert run["engine_idle_frac"] is not None
    assert max(int(k) for k in runs_[0]["staleness_histogram"]) == 0
    assert {p["bound"] for p in runs_[0]["reward_curve"]} == {0}
    curve = runs_[1]["reward_curve"]
    assert [p["bound"] for p in curve[:2]] == [0, 1] and curve[1]["auto_change"] == 1
    assert curve[1]["auto_reason"] == Reason.LEARNER_WAITS
    assert all(p["mismatch_kl"] is not None for p in curve)
    # A group trained at step k was admitted while the bound of step k - 1 or earlier held.
    assert all(p["staleness_mean"] <= max(q["bound"] for q in curve[: i + 1])
               for i, p in enumerate(curve))  # fmt: skip
    assert max(int(k) for k in runs_[1]["staleness_histogram"]) <= max(p["bound"] for p in curve)
    assert [s["eta"] for s in out["settings"]] == [0, "auto"]


@pytest.mark.slow
def test_sync_vs_async_measures_both_runs_and_each_stage_alone(tmp_path):
    result = _bench("sync-vs-async", "bench/configs/cpu_tiny.toml", "--steps", "3", *SMOKE_SETS,
                    "--work-dir", str(tmp_path / "work"), "--json", str(tmp_path / "a.json"),
                    timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((tmp_path / "a.json").read_text())["result"]
    assert out["runs"]["sync"]["staleness_histogram"] == {"0": 6}
    assert out["generation_alone"]["trainable_tokens_per_s"] > 0
    assert out["training_alone"]["batches"] == 3
    assert out["pipeline_efficiency"] > 0
