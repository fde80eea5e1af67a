"""The token budgets of a question and its answer, read by the session, the needle grid, the page and the command
line (whose `--help` shows them without loading torch, so this module imports nothing)."""

DEFAULT_MAX_NEW_TOKENS = 64
"""Tokens an answer may take unless told otherwise (`max_new_tokens`)."""

QUESTION_RESERVE_TOKENS = 64
"""Tokens a prefill keeps free for a question, on top of the answer's `max_new_tokens`."""
