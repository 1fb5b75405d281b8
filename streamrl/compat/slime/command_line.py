"""`streamrl from-slime`: a slime command line (train.py / train_async.py flags and the
model script's MODEL_ARGS) as a streamrl config.

    streamrl from-slime run-qwen3-4B.sh --out config.toml
    streamrl from-slime --out config.toml scripts/models/qwen3-4B.sh -- python train.py --rollout-batch-size 32 ...

Every flag is either mapped to a key (the written file names it beside the key) or
listed as not mapped with the reason (printed, and as comments at the top of the file).
slime's defaults that differ from streamrl's are written out (chat template off without
`--apply-chat-template`, one sample per prompt, per-sample loss averaging); so are the
facts of slime's setup: Megatron learner, SGLang engines on their own GPUs (shared with
`--colocate`), Ray for several actor nodes. The model is `--hf-checkpoint`, or, for a
sourced `scripts/models/<name>.sh` streamrl ships the config.json of
(`configs/models/<name>/`), that shape: enough for `streamrl check`, not for a run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from streamrl.compat.slime import flags as table
from streamrl.compat.slime.scripts import DRIVERS, SlimeCommand, read_command, split_flags
from streamrl.compat.slime.written import Conversion, render, report, text_of

MODELS_DIR = Path(__file__).resolve().parents[3] / "configs" / "models"
"""Where streamrl ships the config.json facts of the models slime users train."""
COMPAT_GENERATE = "streamrl.compat.slime:generate"


SPECIAL = frozenset(
    {
        "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--colocate",
        "--advantage-estimator", "--disable-grpo-std-normalization", "--use-kl-loss",
        "--kl-loss-coef", "--use-tis", "--calculate-per-token-loss",
        "--custom-generate-function-path", "--custom-rm-path", "--group-rm", "--reward-key",
        "--rm-type", "--rm-url", "--eval-prompt-data", "--n-samples-per-eval-prompt",
        "--eval-max-response-len", "--eval-temperature", "--eval-top-p", "--eval-top-k",
        "--debug-rollout-only", "--debug-train-only", "--save-debug-rollout-data",
        "--load-debug-rollout-data", "--hf-checkpoint", "--async-buffer-size", "--optimizer",
        "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
        "--num-gpus-per-node", "--update-weights-interval",
    }
)  # fmt: skip


def convert(command: SlimeCommand) -> Conversion:
    """Map every flag of `command` (module docstring)."""
    out = Conversion()
    flags = split_flags(command.words)
    given = {flag: values for flag, values in flags}
    for flag, values in flags:
        if flag in table.KEYS:
            rule = table.KEYS[flag]
            out.set(rule.key, rule.convert(values), text_of(flag, values))
            if rule.note:
                out.notes.append(f"{flag}: {rule.note}")
        elif flag in table.SHAPE:
            out.skip(flag, values, table.SHAPE_REASON)
        elif flag in table.NOT_MAPPED:
            out.skip(flag, values, table.NOT_MAPPED[flag])
        elif flag.startswith("--sglang-"):
            extra = out.get("engine.extra_args", [])
            out.set("engine.extra_args", [*extra, f"--{flag[len('--sglang-') :]}", *values], flag)
        elif flag not in SPECIAL:
            out.skip(flag, values, "no streamrl counterpart known to `streamrl from-slime`")
    _driver(out, command)
    _resources(out, given)
    _algorithm(out, given)
    _functions(out, given)
    _evaluation(out, given)
    _debug_modes(out, given)
    _update_interval(out, given)
    _model(out, given, command)
    _slime_defaults(out, given)
    for word in command.unexpanded:
        out.notes.append(f"{word}: not expanded (no input defines it); its flags are missing")
    for name in command.unread:
        out.notes.append(f"source {name}: not read (no such file here)")
    return out


def _driver(out: Conversion, command: SlimeCommand) -> None:
    mode = {"train.py": "sync", "train_async.py": "async"}.get(command.driver)
    if mode:
        out.set("train.mode", mode, command.driver)
    out.set("learner.backend", "megatron", "slime trains with Megatron")
    out.set("engine.backend", "sglang", "slime serves with SGLang")


def _resources(out: Conversion, given: dict[str, list[str]]) -> None:
    nodes = table.integer(given.get("--actor-num-nodes", ["1"]))
    per_node = table.integer(given.get("--actor-num-gpus-per-node", ["1"]))
    source = f"--actor-num-nodes {nodes} x --actor-num-gpus-per-node {per_node}"
    out.set("learner.num_gpus", nodes * per_node, source)
    if nodes > 1:
        out.set("cluster.launcher", "ray", "--actor-num-nodes > 1")
    if "--rollout-num-gpus" not in given:
        return
    num_gpus = table.integer(given["--rollout-num-gpus"])
    tp_size = out.get("engine.tp_size", 1)
    out.set("engine.num_engines", max(num_gpus // tp_size, 1), f"--rollout-num-gpus {num_gpus}")
    if num_gpus % tp_size:
        out.notes.append(f"--rollout-num-gpus {num_gpus} is not a multiple of {tp_size} per engine")
    node_size = table.integer(given.get("--num-gpus-per-node", ["8"]))
    is_colocated = "--colocate" in given
    if not is_colocated and nodes == 1 and per_node + num_gpus > node_size:
        out.set("cluster.launcher", "ray", f"{per_node} + {num_gpus} GPUs > {node_size} a node")
        out.notes.append(
            f"the actor's {per_node} GPUs and the rollout's {num_gpus} do not fit one node of "
            f"{node_size} (slime --num-gpus-per-node): Ray places the engines on another node"
        )
    if nodes > 1 or out.get("cluster.launcher") == "ray":
        return  # Ray places the engines
    if is_colocated:
        gpus = list(range(num_gpus))
        out.set("cluster.engine_gpus", gpus, "--colocate")
        _colocate(out)
    else:
        gpus = list(range(nodes * per_node, nodes * per_node + num_gpus))
        out.set("cluster.engine_gpus", gpus, "slime puts the rollout GPUs after the actor's")


def _colocate(out: Conversion) -> None:
    """slime's colocated mode: synchronous (train.py; train_async.py refuses --colocate),
    the engines' memory released while the learner trains and the learner offloaded while
    they generate (--colocate turns --offload-train and --offload-rollout on)."""
    mode = out.get("train.mode", None)
    if mode not in (None, "sync"):
        out.notes.append(
            f"--colocate with train.mode = {mode!r} (slime refuses it with train_async.py): "
            f"the engines share the learner's GPUs and both stay resident, so memory must "
            f"hold both; cluster.colocate needs train.mode = 'sync'"
        )
        return
    if mode is None:
        out.set("train.mode", "sync", "--colocate (slime's colocated loop is train.py's)")
    out.set("cluster.colocate", True, "--colocate")
    out.set("learner.offload", "all", "--colocate (slime's --offload-train: weights too)")


def _algorithm(out: Conversion, given: dict[str, list[str]]) -> None:
    estimator = table.one(given.get("--advantage-estimator", ["grpo"]))
    source = f"--advantage-estimator {estimator}"
    if estimator in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        out.set("algorithm.advantage_estimator", estimator, source)
    elif estimator in ("gspo", "cispo"):
        out.set("algorithm.advantage_estimator", "grpo", source)
        out.set("algorithm.loss", estimator, source)
    elif estimator == "ppo":
        out.set(
            "algorithm.advantage_estimator", "gae", f"{source} (a critic in the learner's layout)"
        )
    else:
        out.skip("--advantage-estimator", [estimator], "not an estimator streamrl has; kept grpo")
    if "--disable-grpo-std-normalization" in given:
        out.set("algorithm.advantage_estimator", "dr_grpo", "--disable-grpo-std-normalization")
    coef = given.get("--kl-loss-coef")
    if "--use-kl-loss" in given and coef:
        out.set(
            "algorithm.kl_loss_coef", table.number(coef), f"--use-kl-loss --kl-loss-coef {coef[0]}"
        )
    elif coef:
        out.skip("--kl-loss-coef", coef, "without --use-kl-loss there is no KL loss (as in slime)")
    elif "--use-kl-loss" in given:
        out.skip("--use-kl-loss", [], "no --kl-loss-coef: a coefficient of 0 loads no reference")
    if "--use-tis" in given:
        out.set("algorithm.off_policy_correction", "tis", "--use-tis")
    if "--calculate-per-token-loss" in given:
        out.set("algorithm.loss_aggregation", "token_mean", "--calculate-per-token-loss")
    else:
        out.set("algorithm.loss_aggregation", "seq_mean", "slime's default: each sample's mean")
    if "--async-buffer-size" in given:
        rollouts = table.integer(given["--async-buffer-size"])
        batch = out.get("rollout.batch_size", 8)
        out.set("buffer.capacity", rollouts * batch, f"--async-buffer-size {rollouts} (x batch)")
        out.notes.append("--async-buffer-size counts rollouts; buffer.capacity counts groups")
    optimizer = given.get("--optimizer")
    if optimizer and table.one(optimizer) != "adam":
        out.skip("--optimizer", optimizer, "AdamW is the one optimizer")
    elif optimizer:
        out.sources.setdefault("learner.lr", []).append("--optimizer adam (AdamW)")
    _recompute(out, given)


def _recompute(out: Conversion, given: dict[str, list[str]]) -> None:
    """Megatron's full recompute: `block` with N layers recomputes the first N of each stage
    (learner.megatron.recompute_layers); `uniform` recomputes every layer, one at a time."""
    if "--recompute-granularity" not in given:
        for flag in ("--recompute-method", "--recompute-num-layers"):
            if flag in given:
                out.skip(flag, given[flag], "Megatron takes it only with --recompute-granularity")
        return
    granularity = table.one(given["--recompute-granularity"])
    out.set("learner.gradient_checkpointing", True,
            text_of("--recompute-granularity", given["--recompute-granularity"]))  # fmt: skip
    if granularity != "full":
        out.notes.append(
            f"--recompute-granularity {granularity}: streamrl recomputes whole layers (full)"
        )
    method = table.one(given.get("--recompute-method", []))
    layers = given.get("--recompute-num-layers")
    if method == "block" and layers:
        out.set("learner.megatron.recompute_layers", table.integer(layers),
                "--recompute-method block --recompute-num-layers")  # fmt: skip
    elif method == "uniform" and layers and table.integer(layers) > 1:
        out.notes.append(
            f"--recompute-method uniform --recompute-num-layers {table.integer(layers)}: "
            f"streamrl recomputes every layer alone (the same work, each layer's input kept)"
        )


def _functions(out: Conversion, given: dict[str, list[str]]) -> None:
    """Custom generate / reward functions run through `streamrl.compat.slime`."""
    function = table.one(given.get("--custom-generate-function-path", []))
    reward = table.one(given.get("--custom-rm-path", []))
    key = table.one(given.get("--reward-key", []))
    rm_type = table.one(given.get("--rm-type", []))
    if function or reward:
        is_group = "--group-rm" in given
        name = "streamrl.compat.slime:generate_group" if is_group else COMPAT_GENERATE
        out.set("rollout.generate_fn", name, "--custom-generate-function-path / --custom-rm-path")
        kwargs = {
            "function": function,
            "reward": reward,
            "group_reward": is_group,
            "reward_key": key,
        }
        out.set(
            "rollout.generate_kwargs", {k: v for k, v in kwargs.items() if v}, "slime functions"
        )
    elif "--group-rm" in given:
        out.skip("--group-rm", [], "only with --custom-rm-path (a group reward function)")
    if rm_type in ("math", "boxed_math"):
        out.set("rollout.reward_fn", "streamrl.rewards.math:math_reward", f"--rm-type {rm_type}")
    elif rm_type == "remote_rm":
        url = table.one(given.get("--rm-url", []))
        out.set("rollout.reward_fn", "streamrl.rewards.remote:remote_reward", "--rm-type remote_rm")
        kwargs = {"url": url, **({"reward_key": key} if key else {})}
        out.set("rollout.reward_kwargs", kwargs, f"--rm-url {url}")
    elif rm_type:
        out.skip("--rm-type", [rm_type], "no built-in reward of that name: bring it as "
                 "--custom-rm-path (rollout.generate_kwargs.reward)")  # fmt: skip
    if key and not (function or reward or rm_type == "remote_rm"):
        out.skip("--reward-key", [key], "only with a custom or remote reward")


def _evaluation(out: Conversion, given: dict[str, list[str]]) -> None:
    pairs = given.get("--eval-prompt-data", [])
    if len(pairs) % 2:
        out.skip("--eval-prompt-data", pairs, "expected NAME PATH pairs")
        pairs = []
    datasets = []
    used = [text_of("--eval-prompt-data", pairs)]
    for flag in ("--n-samples-per-eval-prompt", "--eval-max-response-len", "--eval-temperature",
                 "--eval-top-p", "--eval-top-k"):  # fmt: skip
        if flag in given:
            used.append(text_of(flag, given[flag]))
    for name, path in zip(pairs[::2], pairs[1::2], strict=True):
        dataset: dict[str, Any] = {"name": name, "path": path}
        if "--n-samples-per-eval-prompt" in given:
            dataset["n_samples_per_prompt"] = table.integer(given["--n-samples-per-eval-prompt"])
        sampling = {}
        for flag, key, convert in (
            ("--eval-max-response-len", "max_new_tokens", table.integer),
            ("--eval-temperature", "temperature", table.number),
            ("--eval-top-p", "top_p", table.number),
            ("--eval-top-k", "top_k", table.integer),
        ):
            if flag in given:
                sampling[key] = convert(given[flag])
        if sampling:
            dataset["sampling"] = sampling
        datasets.append(dataset)
    if datasets:
        out.set("eval.datasets", datasets, "; ".join(used))
    else:
        if "--eval-interval" in given:
            out.notes.append("--eval-interval without --eval-prompt-data: no set to evaluate")
        for flag in used[1:]:
            out.skip(flag, [], "no --eval-prompt-data: no set to evaluate")


def _debug_modes(out: Conversion, given: dict[str, list[str]]) -> None:
    if "--debug-rollout-only" in given:
        out.set("train.mode", "rollout_only", "--debug-rollout-only")
    if "--save-debug-rollout-data" in given:
        out.set("train.save_rollouts", True, "--save-debug-rollout-data (to run_dir/rollouts/)")
    if "--debug-train-only" in given or "--load-debug-rollout-data" in given:
        path = table.one(given.get("--load-debug-rollout-data", []))
        out.set("train.mode", "train_only", "--debug-train-only")
        out.set("train.load_rollouts", str(Path(path).parent) if path else "", "a directory here")


def _update_interval(out: Conversion, given: dict[str, list[str]]) -> None:
    """`--update-weights-interval N` (rollouts between pushes; one version per rollout step):
    `weights.update_interval`, with a staleness bound that lets the run progress (the engines
    serve up to N - 1 versions behind the learner: `buffer.max_staleness` >= N - 1)."""
    flag = "--update-weights-interval"
    if flag not in given:
        return
    values = given[flag]
    interval = table.integer(values)
    mode = out.get("train.mode", "async")
    if interval > 1 and mode == "sync":
        out.skip(flag, values, "train.py is synchronous: each step trains on the version the "
                 "engines serve, so every version is pushed")  # fmt: skip
        return
    out.set("weights.update_interval", interval, text_of(flag, values))
    from streamrl.config import BufferConfig

    bound = out.get("buffer.max_staleness", BufferConfig().max_staleness)
    if mode == "async" and interval - 1 > bound:
        out.set("buffer.max_staleness", interval - 1, f"{text_of(flag, values)}: the engines "
                f"serve up to {interval - 1} versions behind the learner")  # fmt: skip


def _model(out: Conversion, given: dict[str, list[str]], command: SlimeCommand) -> None:
    checkpoint = table.one(given.get("--hf-checkpoint", []))
    shipped = MODELS_DIR / command.model_script.lower() if command.model_script else None
    if checkpoint:
        out.set("model.path", checkpoint, f"--hf-checkpoint {checkpoint}")
    elif shipped is not None and (shipped / "config.json").is_file():
        out.set(
            "model.path", _relative(shipped), f"source scripts/models/{command.model_script}.sh"
        )
        out.notes.append(
            f"model.path is streamrl's copy of {command.model_script}'s config.json (the shape, "
            f"no weights): `streamrl check` accepts it; set the checkpoint directory to run"
        )
    else:
        out.notes.append("no --hf-checkpoint: set model.path to the Hugging Face directory")
    config_json = Path(out.get("model.path", "")) / "config.json"
    if config_json.is_file():
        _compare_shape(out, given, json.loads(config_json.read_text()), config_json)


def _compare_shape(out: Conversion, given: dict, config: dict, where: Path) -> None:
    compared = 0
    for flag, fields in table.SHAPE_FIELDS.items():
        if flag not in given:
            continue
        name = next((f for f in fields if f in config), None)
        if name is None or config[name] is None:
            continue
        value = table.one(given[flag])
        try:
            same = float(value) == float(config[name])
        except ValueError:
            same = False
        compared += 1
        if not same:
            out.notes.append(f"MODEL_ARGS {flag} {value} but {where} has {name} = {config[name]}")
    if compared and not any(note.startswith("MODEL_ARGS") for note in out.notes):
        out.notes.append(f"MODEL_ARGS: the {compared} shape flags with a config.json field agree "
                         f"with {where}")  # fmt: skip


def _slime_defaults(out: Conversion, given: dict[str, list[str]]) -> None:
    """slime's defaults where streamrl's differ."""
    if "--apply-chat-template" not in given:
        out.set("data.apply_chat_template", False, "slime's default (no --apply-chat-template)")
    if "--n-samples-per-prompt" not in given:
        out.set("rollout.n_samples_per_prompt", 1, "slime's default")
    for flag, key in (
        ("--rollout-max-response-len", "rollout.sampling.max_new_tokens"),
        ("--rollout-batch-size", "rollout.batch_size"),
        ("--num-rollout", "train.steps"),
    ):
        if flag not in given:
            out.notes.append(f"no {flag}: streamrl's default {key} applies")


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def from_slime_command(args) -> int:
    """Entry point of `streamrl from-slime` (`streamrl.cli`)."""
    from streamrl.config import ConfigError
    from streamrl.config.loading import apply_override, config_from_dict

    scripts, argv = _split_inputs(args.inputs)
    command = read_command(scripts, argv)
    if not command.words:
        print("error: no train.py / train_async.py command line found", file=sys.stderr)
        return 2
    conversion = convert(command)
    source = ", ".join(map(str, scripts)) or "the command line"
    if argv and scripts:
        source += " and the command line"
    for item in args.overrides:
        apply_override(conversion.raw, item)
        conversion.sources[item.partition("=")[0].strip()] = ["--set"]
    text = render(conversion, source=source)
    print(report(conversion), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    try:
        config_from_dict({k: v for k, v in conversion.raw.items() if v}, source=args.out or "<out>")
    except ConfigError as exc:
        print(f"error: the written config does not validate: {exc}", file=sys.stderr)
        return 2
    return 0


def _split_inputs(inputs: list[str]) -> tuple[list[str], list[str]]:
    """Leading existing files are scripts; the rest (given after `--`) is the command line."""
    scripts = []
    for index, item in enumerate(inputs):
        if not Path(item).is_file() or item.endswith(DRIVERS):
            return scripts, inputs[index:]
        scripts.append(item)
    return scripts, []
