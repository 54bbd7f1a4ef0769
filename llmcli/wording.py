"""How counts read in what llmcli says: `counted(1, "pair")` is "1 pair", `counted(1200,
"pair")` "1,200 pairs" (thousands separated, as every count a user reads), and `first_few`
names the first rows of a list ("a.jsonl line 3, a.jsonl line 9 and 4 more")."""

from __future__ import annotations

from collections.abc import Sequence


def counted(n: int, word: str, plural: str | None = None) -> str:
    """`n` and the noun for it: "1 pair", "0 pairs", "12,000 conversations"; `plural` for a
    noun that does not take an s ("1 reply", plural "replies")."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def first_few(items: Sequence[str], shown: int = 3) -> str:
    """The first `shown` of `items`, joined, and how many more there are."""
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head} and {len(items) - shown:,} more"
