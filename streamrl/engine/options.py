"""`EngineOptions`: every option of the embedded engine, spelled once.

The same Struct is what `streamrl engine serve` parses (its flags are generated
from the fields: `max_batch_size` is `--max-batch-size`, a bool `cuda_graphs`
is `--cuda-graphs` / `--no-cuda-graphs`), what the launcher builds from
`[engine]` and passes whole (`to_argv`), and what `EngineCore` takes. The
config's `[engine]` keys of the same names (`device`, `dtype`,
`max_batch_size`, ...) are copied over by name (`SHARED_WITH_CONFIG`), so a new
option is added here and, if users set it per run, under `[engine]`.

Imports nothing heavy: `streamrl --help` builds the parser from it.
"""

from __future__ import annotations

import argparse
import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[str, Meta(description="HF directory, `smollm2`, or random:<shape>")]
    tokenizer: Annotated[str, Meta(description="tokenizer directory (empty: the model's)")] = ""
    host: Annotated[str, Meta(description="address to bind")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="port to bind")] = 30000
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Meta(description="auto: CUDA when present")
    ] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Meta(description="auto: float32 on CPU, bfloat16 on CUDA"),
    ] = "auto"
    max_batch_size: Annotated[int, Meta(gt=0, description="sequences decoded together")] = 64
    max_seq_len: Annotated[
        int, Meta(gt=0, description="prompt + response tokens per sequence (KV slot size)")
    ] = 2048
    max_prefill_tokens: Annotated[
        int, Meta(ge=0, description="tokens prefilled per step (0: 32768 on CUDA, 4096 on CPU)")
    ] = 0
    runner: Annotated[
        Literal["auto", "compact", "hf"],
        Meta(description="compact: streamrl's decoder (Llama/Qwen2/Qwen3); hf: transformers"),
    ] = "auto"
    cuda_graphs: Annotated[bool, Meta(description="decode steps as CUDA graphs (compact)")] = True
    compile: Annotated[
        Literal["auto", "on", "off"],
        Meta(description="torch.compile the small elementwise kernels (auto: on CUDA)"),
    ] = "auto"
    seed: Annotated[int, Meta(description="seed for random models and sampling")] = 0
    weight_version: Annotated[str, Meta(description="the version the weights start at")] = "default"
    num_threads: Annotated[int, Meta(ge=0, description="torch CPU threads (0: default)")] = 0
    lora_adapter: Annotated[
        str, Meta(description="peft adapter directory merged into the weights at start")
    ] = ""
    admit_hold_steps: Annotated[
        int,
        Meta(
            ge=0,
            description="decode steps that requests still arriving in a burst may wait, while "
            "others decode, to be prefilled together (0: each step admits what has come)",
        ),
    ] = 16
    switch_interval_ms: Annotated[
        float,
        Meta(
            gt=0,
            description="Python's GIL switch interval in the server process (Python's own is 5): "
            "the longest the engine thread waits for the GIL while the HTTP thread works",
        ),
    ] = 0.5
    http_process: Annotated[
        Literal["auto", "on", "off"],
        Meta(
            description="answer HTTP in a process of its own, the model in a child process, "
            "generation between them over ZeroMQ, so that parsing and rendering never hold "
            "the engine thread's GIL (auto: on CUDA)"
        ),
    ] = "auto"
    http_processes: Annotated[
        int,
        Meta(
            ge=1,
            le=64,
            description="HTTP processes in front of the one model process, all on the one "
            "port (SO_REUSEPORT); more than one implies --http-process on",
        ),
    ] = 1
    bridge: Annotated[
        str,
        Meta(
            description="set by the HTTP process of --http-process for its engine process "
            "(and for the other HTTP processes of --http-processes): the directory of the "
            "ZeroMQ sockets of generation (empty: none)"
        ),
    ] = ""
    front_index: Annotated[
        int,
        Meta(
            ge=0,
            description="set by the first HTTP process of --http-processes for the others it "
            "starts: this one's index (0: the first, or the only one)",
        ),
    ] = 0
    engine_port: Annotated[
        int,
        Meta(
            ge=0,
            description="set with --front-index: the engine process's loopback port",
        ),
    ] = 0

    @property
    def compile_elementwise(self) -> bool | None:
        """`compile` as the runner takes it: None (auto), True or False."""
        return {"auto": None, "on": True, "off": False}[self.compile]

    def to_argv(self) -> list[str]:
        """`streamrl engine serve` flags that rebuild these options (non-defaults only)."""
        argv: list[str] = []
        for name, default in _defaults().items():
            value = getattr(self, name)
            if value == default and default is not _REQUIRED:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else f"--no-{name.replace('_', '-')}")
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, with its type, choices, default and description."""
        hints = typing.get_type_hints(cls, include_extras=True)
        for name, default in _defaults().items():
            kind, meta = _unwrap(hints[name])
            flag = "--" + name.replace("_", "-")
            help_text = meta.description if meta is not None else None
            if kind is bool:
                parser.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=default
                )
                continue
            kwargs: dict = {"dest": name, "help": help_text}
            if typing.get_origin(kind) is Literal:
                kwargs["choices"] = list(typing.get_args(kind))
            else:
                kwargs["type"] = kind
            if default is _REQUIRED:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EngineOptions:
        """The options `add_arguments` parsed (ValueError naming the flag on a bad value)."""
        values = {name: getattr(args, name) for name in cls.__struct_fields__}
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"streamrl engine serve: {exc}") from None


_REQUIRED = object()

SHARED_WITH_CONFIG = (
    "device",
    "dtype",
    "max_batch_size",
    "max_seq_len",
    "runner",
    "cuda_graphs",
    "compile",
    "num_threads",
    "http_processes",
)
"""Options copied by name from the run config's `[engine]` section."""


def _defaults() -> dict[str, object]:
    fields = EngineOptions.__struct_fields__
    defaults = EngineOptions.__struct_defaults__
    padded = (_REQUIRED,) * (len(fields) - len(defaults)) + tuple(defaults)
    return dict(zip(fields, padded, strict=True))


def _unwrap(hint) -> tuple[object, Meta | None]:
    """`Annotated[T, Meta(...)]` -> (T, Meta); anything else -> (hint, None)."""
    if typing.get_origin(hint) is Annotated:
        kind, *extras = typing.get_args(hint)
        meta = next((extra for extra in extras if isinstance(extra, Meta)), None)
        return kind, meta
    return hint, None
