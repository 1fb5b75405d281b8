"""`[engine]`'s keys that an embedded engine takes as `streamrl engine serve` flags
(`streamrl.engine.options.SHARED_WITH_CONFIG`): the same defaults on both sides, and a
value set in the config reaches the engine's command line."""

from __future__ import annotations

import msgspec

from streamrl.config import config_from_dict
from streamrl.config.sections import EngineConfig
from streamrl.engine.options import SHARED_WITH_CONFIG, EngineOptions
from streamrl.fleet.commands import embedded_options


def test_every_shared_key_has_the_engines_default_in_the_config():
    config_defaults = msgspec.structs.asdict(EngineConfig())
    option_defaults = dict(
        zip(EngineOptions.__struct_fields__[-len(EngineOptions.__struct_defaults__):],
            EngineOptions.__struct_defaults__, strict=True)
    )  # fmt: skip
    assert {name: config_defaults[name] for name in SHARED_WITH_CONFIG} == {
        name: option_defaults[name] for name in SHARED_WITH_CONFIG
    }


def test_http_processes_set_under_engine_reach_the_engines_flags():
    cfg = config_from_dict(
        {
            "model": {"path": "/models/m"},
            "data": {"path": "prompts.jsonl"},
            "engine": {"http_processes": 3, "max_batch_size": 32},
        }
    )
    options = embedded_options(
        cfg, model_path="/models/m", version=0, index=1, host="127.0.0.1", port=30001
    )
    argv = options.to_argv()
    assert options.http_processes == 3
    assert argv[argv.index("--http-processes") + 1] == "3"
    assert argv[argv.index("--max-batch-size") + 1] == "32"
