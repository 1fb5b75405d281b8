"""Prompt data: `rows` reads and checks a data set's records, `source` turns them into
the run's resumable stream of rendered prompts (`PromptSource`)."""
