"""What code written for other RL frameworks imports, so that it runs under streamrl.

`streamrl.compat.slime`: slime's `Sample`, `post`, `GenerateState`, and the generate
function that runs a slime custom generate function and reward (docs/slime-functions.md).
"""
