"""`streamrl check CONFIG`: everything a run would trip over at its start, found before it.

Beyond the config's own validation (types, ranges, rules across sections), it imports the
user's code (reward, generate and filter functions), reads every data file (each record
up to `MAX_DATA_ROWS`, parsed and validated by the run's own reader, `streamrl.data.rows`; the
first bad record is named as `path:line` with the number of bad ones; the first record must
hold the label key), and checks that every model path exists and that its config loads.
With the model's shape known, `streamrl.planner` counts each GPU's expected peak and a GPU
that cannot hold it is a problem (docs/memory.md). Each problem names its dotted key; any
problem gives exit code 2. On success the memory plan is printed as TOML comments, then the
resolved config (the whole output loads back identically).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from streamrl.config import ConfigError, RunConfig, dump_toml, load_config

log = logging.getLogger(__name__)


def check_command(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "against", None):
        return against_command(cfg, Path(args.against), json_path=getattr(args, "json", None))
    problems = find_problems(cfg)
    for problem in problems:
        print(f"error: {args.config}: {problem}", file=sys.stderr)
    if problems:
        if any(problem.endswith("(docs/memory.md)") for problem in problems):
            for line in memory_plan_lines(cfg):  # the breakdown behind the refusal
                print(f"# {line}", file=sys.stderr)
        return 2
    for line in memory_plan_lines(cfg):  # as TOML comments: the output still loads back
        print(f"# {line}")
    print(dump_toml(cfg), end="")
    return 0


COLOCATED_SCHEDULE = (
    "colocated (cluster.colocate): a synchronous schedule; each step the engines release "
    "their memory, the learner reloads, trains and offloads (learner.offload = {offload!r}), "
    "the engines resume and take the new weights, then generate (docs/memory.md)"
)


def against_command(cfg: RunConfig, run_dir: Path, *, json_path: str | None = None) -> int:
    """`streamrl check CONFIG --against RUN_DIR`: the plan of `cfg` next to the peaks the
    run measured (`streamrl.planner.measured`); exit 2 when either is missing."""
    import json

    from streamrl.planner.measured import TARGET_ERROR, compare, comparison_lines

    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        print(f"error: {summary_path}: no such file (has the run finished?)", file=sys.stderr)
        return 2
    summary = json.loads(summary_path.read_text())
    plan, reason = _memory_plan(cfg)
    if plan is None:
        print(f"error: no memory plan: {reason}", file=sys.stderr)
        return 2
    rows = compare(plan, summary.get("memory"))
    for line in memory_plan_lines(cfg):
        print(f"# {line}")
    print(f"planned against measured peaks of {run_dir} (target: within {TARGET_ERROR:.0%})")
    for line in comparison_lines(rows):
        print(line)
    if json_path:
        result = {
            "run_dir": str(run_dir),
            "plan": plan.to_dict(),
            "measured": summary.get("memory"),
            "rows": [row.to_dict() for row in rows],
            "target_error": TARGET_ERROR,
        }
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def memory_plan_lines(cfg: RunConfig) -> list[str]:
    """`streamrl.planner`'s breakdown of each GPU's peak, or the line saying why there is none;
    first, in colocated mode, the schedule that implies."""
    from streamrl.planner.report import plan_lines

    lines = []
    if cfg.cluster.colocate:
        lines.append(COLOCATED_SCHEDULE.format(offload=cfg.learner.offload))
    plan, reason = _memory_plan(cfg)
    return lines + (plan_lines(plan) if plan is not None else [f"memory plan: none ({reason})"])


def _memory_plan(cfg: RunConfig):
    """(the plan, "") or (None, why not): SmolLM2 (135M parameters) and a model whose
    config does not load (reported under model.path) or whose family the shapes do not
    read are not planned."""
    from streamrl import models
    from streamrl.planner import plan_memory

    if cfg.model.path == models.SMOLLM2_NAME:
        return None, "SmolLM2-135M fits any GPU"
    try:
        return plan_memory(cfg), ""
    except (NotImplementedError, ValueError, KeyError, AttributeError, OSError) as exc:
        return None, f"the model's shape does not read: {exc}"


def find_problems(cfg: RunConfig, *, models: bool = True) -> list[str]:
    """Every problem of `cfg` beyond its validation, each starting with its dotted key.

    `models=False` leaves out the checks that open a model or tokenizer (`model.path`,
    `model.tokenizer`, `learner.critic.path`): the docs test checks the configs it finds
    that way, since their model paths name directories of other machines."""
    problems: list[str] = []

    def attempt(key: str, check: Callable[[], None]) -> None:
        try:
            check()
        except Exception as exc:
            message = str(exc)
            section = key.rpartition(".")[0] + "."  # a message may name a sibling key
            named = message.startswith(key) or message.startswith(section)
            problems.append(message if named else f"{key}: {message}")

    attempt(
        "rollout.reward_fn", lambda: _load_reward(cfg.rollout.reward_fn, cfg.rollout.reward_kwargs)
    )
    attempt(
        "rollout.generate_fn",
        lambda: _import_callable(cfg.rollout.generate_fn, "rollout.generate_fn"),
    )
    attempt("rollout.generate_kwargs", lambda: _check_generate_kwargs(cfg))
    attempt("buffer.filters", lambda: _load_filters(cfg))
    if cfg.train.mode != "train_only":
        attempt(
            "data.path",
            lambda: check_data_file(cfg.data.path, cfg.data.input_key, cfg.data.label_key, cfg),
        )
    for index, dataset in enumerate(cfg.eval.datasets):
        key = f"eval.datasets[{index}]"
        attempt(
            f"{key}.path",
            lambda d=dataset: check_data_file(d.path, d.input_key, d.label_key, cfg),
        )
        if dataset.reward_fn:
            attempt(
                f"{key}.reward_fn",
                lambda d=dataset, k=key: _load_reward(
                    d.reward_fn, d.reward_kwargs, key=f"{k}.reward_fn"
                ),
            )
    if models:
        attempt("model.path", lambda: _check_model(cfg.model.path))
        if cfg.model.tokenizer:
            attempt("model.tokenizer", lambda: _check_directory(cfg.model.tokenizer))
        if cfg.learner.backend == "megatron" or cfg.engine.backend == "sglang":
            attempt("learner.megatron", lambda: problems.extend(_layout_problems(cfg)))
        if cfg.algorithm.advantage_estimator == "gae" and cfg.learner.critic.path:
            attempt("learner.critic.path", lambda: _check_model(cfg.learner.critic.path))
            if cfg.learner.backend == "megatron":
                attempt(
                    "learner.critic.path", lambda: problems.extend(_critic_layout_problems(cfg))
                )
        attempt("cluster.gpu_memory_gb", lambda: problems.extend(_memory_problems(cfg)))
    if cfg.train.mode == "train_only":
        attempt("train.load_rollouts", lambda: _check_rollouts(cfg))
    if cfg.logging.wandb:
        attempt("logging.wandb", _check_wandb)
    if models:  # reads the tokenizer's files
        problems.extend(chat_template_problems(cfg))
    return problems


def _load_reward(spec: str, kwargs: dict, *, key: str = "rollout.reward_fn") -> None:
    from streamrl.rewards import load_reward_fn

    load_reward_fn(spec, dict(kwargs), key=key)


def _import_callable(spec: str, key: str) -> None:
    from streamrl.utils import import_object

    obj = import_object(spec, key)
    if not callable(obj):
        raise ValueError(f"{key}: {spec!r} is not callable ({type(obj).__name__})")


def _check_generate_kwargs(cfg: RunConfig) -> None:
    """A generate function that says how to check its options (`check_kwargs(kwargs)`, e.g.
    `streamrl.compat.slime:generate` imports the functions they name) gets them checked."""
    from streamrl.utils import import_object

    try:
        generate_fn = import_object(cfg.rollout.generate_fn, "rollout.generate_fn")
    except ValueError:
        return  # reported under rollout.generate_fn
    check = getattr(generate_fn, "check_kwargs", None)
    if check is not None:
        check(dict(cfg.rollout.generate_kwargs))


def _load_filters(cfg: RunConfig) -> None:
    from streamrl.mains.filters import load_filters

    load_filters(
        cfg.buffer.filters,
        min_response_tokens=cfg.buffer.min_response_tokens,
        max_response_tokens=cfg.buffer.max_response_tokens,
    )


MAX_DATA_ROWS = 1_000_000
"""Records of each data file that `streamrl check` reads and validates; a longer file is
checked up to here (a warning says so) and the run still validates every row at start."""


def check_data_file(path: str, input_key: str, label_key: str, cfg: RunConfig) -> None:
    """Every record up to `MAX_DATA_ROWS` parses and passes the run's own row checks
    (`streamrl.data.rows.checked_rows`, with `data.metadata_key` and `data.apply_chat_template`),
    and the first record holds `label_key`. Raises naming the first bad record (`path:line`)
    and the number of bad ones; with `data.on_bad_line = "skip"` bad records are only
    warned about, as the run skips them, unless every record is bad."""
    from streamrl.data import rows

    scan = rows.scan_rows(
        path,
        max_rows=MAX_DATA_ROWS,
        input_key=input_key,
        label_key=label_key,
        metadata_key=cfg.data.metadata_key,
        allow_messages=cfg.data.apply_chat_template,
    )
    if not scan.is_complete:
        log.warning("%s: only the first %d records were checked", path, MAX_DATA_ROWS)
    if scan.num_rows == 0:
        raise ValueError(f"{path}: no records")
    if scan.num_bad:
        summary = f"{scan.first_error} ({scan.num_bad} of {scan.num_rows} records bad)"
        if cfg.data.on_bad_line == "error" or scan.num_bad == scan.num_rows:
            raise ValueError(summary)
        log.warning("%s; the run skips them (data.on_bad_line = 'skip')", summary)
    _check_first_label(path, label_key)


def _check_first_label(path: str, label_key: str) -> None:
    """The first record holds `label_key` (built-in tasks always use their own keys)."""
    from streamrl.data import rows

    if path.startswith("builtin:"):
        label_key = "label"
    line, obj = next(iter(rows.records(path)))
    if isinstance(obj, dict) and label_key not in obj:
        where = path if path.startswith("builtin:") else f"{path}:{line}"
        raise ValueError(
            f"{where}: the first record has no key {[label_key]} (keys: {sorted(obj)})"
        )


def _check_model(path: str) -> None:
    """A `random:` shape that exists, the installed SmolLM2, or a directory whose config loads."""
    from streamrl import models

    if path.startswith(models.RANDOM_PREFIX):
        models.random_config(path.removeprefix(models.RANDOM_PREFIX))
        return
    if path == models.SMOLLM2_NAME:
        models.smollm2_gguf_path()
        return
    _check_directory(path)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ValueError(f"{path}: its config does not load: {exc}") from None


def _layout_problems(cfg: RunConfig) -> list[str]:
    """How the model splits over the learner's and the SGLang engines' GPUs
    (`streamrl.backends.megatron.memory.layout_problems`), `learner.megatron.recompute_layers`
    beyond a pipeline stage's layers, or the Megatron learner's refusal of the model's
    family; nothing when the model's config does not load (reported under
    model.path) or is SmolLM2's (one GPU)."""
    from streamrl import models
    from streamrl.backends.megatron.families import shape_from_hf
    from streamrl.backends.megatron.memory import (
        Parallelism,
        layout_problems,
        recompute_layers_problem,
    )

    if cfg.model.path == models.SMOLLM2_NAME:
        return []
    try:
        config = models.model_config(cfg.model.path)
    except Exception:
        return []
    try:
        shape = shape_from_hf(config)
    except (NotImplementedError, ValueError, KeyError, AttributeError) as exc:
        if cfg.learner.backend == "megatron":
            return [f"learner.backend = 'megatron': {exc}"]
        return []
    megatron = cfg.learner.megatron
    layout = Parallelism(
        num_gpus=cfg.learner.num_gpus,
        tp=megatron.tensor_parallel_size if cfg.learner.backend == "megatron" else 1,
        pp=megatron.pipeline_parallel_size if cfg.learner.backend == "megatron" else 1,
        ep=megatron.expert_model_parallel_size if cfg.learner.backend == "megatron" else 1,
    )
    engine_tp = cfg.engine.tp_size if cfg.engine.backend == "sglang" else 1
    problems = layout_problems(shape, layout, engine_tp_size=engine_tp)
    if cfg.learner.backend == "megatron" and cfg.learner.gradient_checkpointing:
        stage_layers = shape.num_layers // layout.pp
        if problem := recompute_layers_problem(megatron.recompute_layers, stage_layers):
            problems.append(problem)
    return problems


def _memory_problems(cfg: RunConfig) -> list[str]:
    """What does not fit its GPU by `streamrl.planner`'s count, each naming the key to change."""
    plan, _ = _memory_plan(cfg)
    return plan.problems if plan is not None else []


def _critic_layout_problems(cfg: RunConfig) -> list[str]:
    """The critic's own model (`learner.critic.path`) in the policy's Megatron layout: its
    family supported and its shape split by the same TP / PP / EP (the engines never serve
    it); nothing when its config does not load (reported by the model check)."""
    from streamrl import models
    from streamrl.backends.megatron.families import shape_from_hf
    from streamrl.backends.megatron.memory import Parallelism, layout_problems

    path = cfg.learner.critic.path
    key = f"learner.critic.path = {path!r}"
    try:
        config = models.model_config(path)
    except Exception:
        return []
    try:
        shape = shape_from_hf(config)
    except (NotImplementedError, ValueError, KeyError, AttributeError) as exc:
        return [f"{key}: the megatron learner cannot build it: {exc}"]
    megatron = cfg.learner.megatron
    layout = Parallelism(
        num_gpus=cfg.learner.num_gpus,
        tp=megatron.tensor_parallel_size,
        pp=megatron.pipeline_parallel_size,
        ep=megatron.expert_model_parallel_size,
    )
    return [f"{key}: {problem}" for problem in layout_problems(shape, layout, engine_tp_size=1)]


def _check_directory(path: str) -> None:
    if not Path(path).is_dir():
        raise ValueError(f"{path}: no such directory")


def _check_rollouts(cfg: RunConfig) -> None:
    from streamrl.queues.rollout_files import ReplayIntake

    ReplayIntake(Path(cfg.train.load_rollouts)).check(cfg.train.steps)


def _check_wandb() -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ValueError("the wandb package is not installed: pip install 'streamrl[wandb]'")


# ---- the chat template


def chat_template_problems(cfg: RunConfig) -> list[str]:
    """What renders with the tokenizer's chat template when the tokenizer has none: the
    prompts (`data.apply_chat_template`) and generate functions that declare
    `needs_chat_template` (environments, tools, agents behind the gateway). Without this
    every sample of the run would fail the same way. A tokenizer that does not load is the
    model check's to report."""
    if cfg.train.mode == "train_only":
        return []
    needs = []
    if cfg.data.apply_chat_template:
        needs.append(("data.apply_chat_template", "true renders every prompt with it"))
    if _needs_chat_template(cfg.rollout.generate_fn):
        needs.append(
            ("rollout.generate_fn", f"{cfg.rollout.generate_fn!r} renders every turn with it")
        )
    if not needs or _has_chat_template(cfg.model.tokenizer or cfg.model.path) is not False:
        return []
    source = cfg.model.tokenizer or cfg.model.path
    return [
        f"{key}: {why}, and the tokenizer of {source!r} has no chat template "
        "(model.tokenizer can name a chat model's tokenizer)"
        for key, why in needs
    ]


def _needs_chat_template(spec: str) -> bool:
    from streamrl.utils import import_object

    try:
        generate_fn = import_object(spec, "rollout.generate_fn")
    except ValueError:  # reported as rollout.generate_fn
        return False
    return bool(getattr(generate_fn, "needs_chat_template", False))


def _has_chat_template(path: str) -> bool | None:
    """Whether the tokenizer at `path` has a chat template (None: it does not load)."""
    from streamrl.models import has_chat_template

    try:
        return has_chat_template(path)
    except Exception:
        return None
