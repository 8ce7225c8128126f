"""A tool for `--tool examples/calculator.py:add` (docs/agents.md "Tools"): a type hint on every
parameter and an `Args:` line for each, from which floe builds the schema the chat template shows."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b
