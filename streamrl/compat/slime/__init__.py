"""slime's function contracts under streamrl (docs/slime-functions.md).

What slime code imports, under slime's names:

    from streamrl.compat.slime import Sample          # slime.utils.types.Sample
    from streamrl.compat.slime import post, get       # slime.utils.http_utils
    from streamrl.compat.slime import GenerateState   # slime.rollout.sglang_rollout

and the generate functions that run a slime generate function and reward function in a
streamrl run: `rollout.generate_fn = "streamrl.compat.slime:generate"` (or
`generate_group`) with `rollout.generate_kwargs = { function = ..., reward = ... }`
(`streamrl.compat.slime.generate`). `streamrl from-slime` converts a slime command line
into a config (`streamrl.compat.slime.command_line`).
"""

from streamrl.compat.slime.args import GenerateState
from streamrl.compat.slime.engine_calls import get, post
from streamrl.compat.slime.generate import SlimeOptions, generate, generate_group
from streamrl.compat.slime.sample import Sample

__all__ = ["GenerateState", "Sample", "SlimeOptions", "generate", "generate_group", "get", "post"]
