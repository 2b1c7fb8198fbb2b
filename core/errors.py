"""Errors the CLI turns into one line on stderr and an exit code (DESIGN.md: 1 runtime, 2 bad input)."""


class FlashnextError(Exception):
    """A failure worth one clear line to the user. `exit_code` follows the CLI contract."""

    exit_code = 1


class UserError(FlashnextError):
    """Bad input or usage: the message names the file, field or value and says what to do."""

    exit_code = 2


# One wording wherever a blank prompt is refused (CLI, Python API, engine, server).
EMPTY_PROMPT = "the prompt is empty: give some text"
