"""`streamrl check CONFIG`: everything a run would trip over at its start, found before it.

Beyond the config's own validation (types, ranges, rules across sections), it imports the
user's code (reward, generate and filter functions), opens every data file (the first
record is parsed and must hold the configured keys), and checks that every model path
exists and that its config loads. Each problem names its dotted key; any problem gives
exit code 2. On success the resolved config is printed (it loads back identically).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from streamrl.config import ConfigError, RunConfig, dump_toml, load_config


def check_command(args) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = find_problems(cfg)
    for problem in problems:
        print(f"error: {args.config}: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(dump_toml(cfg), end="")
    return 0


def find_problems(cfg: RunConfig) -> list[str]:
    """Every problem of `cfg` beyond its validation, each starting with its dotted key."""
    problems: list[str] = []

    def attempt(key: str, check: Callable[[], None]) -> None:
        try:
            check()
        except Exception as exc:
            message = str(exc)
            problems.append(message if message.startswith(key) else f"{key}: {message}")

    attempt(
        "rollout.reward_fn", lambda: _import_callable(cfg.rollout.reward_fn, "rollout.reward_fn")
    )
    attempt(
        "rollout.generate_fn",
        lambda: _import_callable(cfg.rollout.generate_fn, "rollout.generate_fn"),
    )
    attempt("buffer.filters", lambda: _load_filters(cfg))
    if cfg.train.mode != "train_only":
        attempt(
            "data.path", lambda: _check_data(cfg.data.path, cfg.data.input_key, cfg.data.label_key)
        )
    for index, dataset in enumerate(cfg.eval.datasets):
        key = f"eval.datasets[{index}]"
        attempt(f"{key}.path", lambda d=dataset: _check_data(d.path, d.input_key, d.label_key))
        if dataset.reward_fn:
            attempt(
                f"{key}.reward_fn",
                lambda d=dataset, k=key: _import_callable(d.reward_fn, f"{k}.reward_fn"),
            )
    attempt("model.path", lambda: _check_model(cfg.model.path))
    if cfg.model.tokenizer:
        attempt("model.tokenizer", lambda: _check_directory(cfg.model.tokenizer))
    if cfg.algorithm.advantage_estimator == "gae" and cfg.learner.critic.path:
        attempt("learner.critic.path", lambda: _check_model(cfg.learner.critic.path))
    if cfg.train.mode == "train_only":
        attempt("train.load_rollouts", lambda: _check_rollouts(cfg))
    if cfg.logging.wandb:
        attempt("logging.wandb", _check_wandb)
    problems.extend(chat_template_problems(cfg))
    return problems


def _import_callable(spec: str, key: str) -> None:
    from streamrl.utils import import_object

    obj = import_object(spec, key)
    if not callable(obj):
        raise ValueError(f"{key}: {spec!r} is not callable ({type(obj).__name__})")


def _load_filters(cfg: RunConfig) -> None:
    from streamrl.mains.filters import load_filters

    load_filters(
        cfg.buffer.filters,
        min_response_tokens=cfg.buffer.min_response_tokens,
        max_response_tokens=cfg.buffer.max_response_tokens,
    )


def _check_data(path: str, input_key: str, label_key: str) -> None:
    """The first record parses and holds `input_key` and `label_key` (built-in tasks always
    use their own keys)."""
    from streamrl import data

    if path.startswith("builtin:"):
        input_key, label_key = "prompt", "label"
    records = iter(data._records(path))
    first = next(records, None)
    if first is None:
        raise ValueError(f"{path}: no records")
    line, obj = first
    where = f"{path}:{line}" if not path.startswith("builtin:") else path
    if isinstance(obj, Exception):
        raise ValueError(f"{where}: {obj}")
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = [key for key in (input_key, label_key) if key not in obj]
    if missing:
        raise ValueError(f"{where}: the first record has no key {missing} (keys: {sorted(obj)})")


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
