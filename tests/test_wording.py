"""Counts as a user reads them (`llmcli.wording`): thousands separated, the noun agreeing."""

from llmcli.wording import counted, first_few


def test_counts_are_separated_and_agree_with_their_noun() -> None:
    assert counted(1, "pair") == "1 pair"
    assert counted(0, "pair") == "0 pairs"
    assert counted(943_744, "parameter") == "943,744 parameters"
    assert counted(1, "reply", "replies") == "1 reply"
    assert counted(2, "reply", "replies") == "2 replies"


def test_first_few_names_three_and_counts_the_rest() -> None:
    assert first_few(["a", "b"]) == "a, b"
    assert first_few(["a", "b", "c"]) == "a, b, c"
    assert first_few([str(i) for i in range(1_005)]) == "0, 1, 2 and 1,002 more"
