"""DPO's and GRPO's settings of the `train:` section: their choices (TRL's names) and rules.

The objectives read these settings (`llmcli.objectives.dpo`, `llmcli.objectives.grpo`,
`llmcli.objectives.rewards`); `TrainConfig.validate` (`llmcli.config.train`) calls these checks of
their choices and of the rules between them, each taking the settings it reads.
"""

from __future__ import annotations

from llmcli.config.lists import names, numbers
from llmcli.config.rules import require
from llmcli.errors import ConfigError, did_you_mean

# GRPO's built-in verifiers (`train.reward`; llmcli.objectives.rewards).
VERIFIERS = ("exact", "number", "contains")


def check_reward_spec(spec: str) -> None:
    """`train.reward` is a built-in verifier or `FILE.py:FUNCTION` (the file is read later)."""
    if spec in VERIFIERS:
        return
    path, _, name = str(spec).rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        hint = did_you_mean(str(spec), VERIFIERS)
        raise ConfigError(
            f"train.reward: {spec!r} is neither a built-in verifier ({', '.join(VERIFIERS)})"
            f" nor FILE.py:FUNCTION, a function of your own file.{hint}"
        )


# DPO's loss types (`train.loss_type`), TRL 1.16's `DPOConfig.loss_type` values but discopop,
# whose tau llmcli does not carry; the formulas are llmcli.objectives.dpo_losses'.
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "sft",
    "sigmoid_norm",
)
# The loss types that read train.label_smoothing (TRL's): to the others it changes nothing.
SMOOTHED_LOSS_TYPES = ("robust", "exo_pair", "aot", "aot_unpaired")

# `train.loss_type`'s choices by objective, TRL 1.16's names, the first the default
# (llmcli.objectives.grpo, llmcli.objectives.dpo_losses).
LOSS_TYPES = {"grpo": ("dapo", "bnpo", "grpo", "dr_grpo"), "dpo": DPO_LOSS_TYPES}


def check_rewards(
    objective: str, reward: str | list[str], reward_weights: list[float] | str | None
) -> None:
    """Each of `reward`'s specs, and `reward_weights` one per reward (GRPO's)."""
    specs = names(reward)
    weights = numbers(reward_weights, "train", "reward_weights", "one per reward")
    require(specs and all(specs), "train", "reward", reward, "must name a reward")
    for spec in specs:
        check_reward_spec(spec)
    if weights is not None:
        if objective != "grpo":
            raise ConfigError(
                f"train.reward_weights ({reward_weights!r}) weighs GRPO's rewards, and "
                f"this run's objective is {objective}: remove it."
            )
        require(
            len(weights) == len(specs),
            "train",
            "reward_weights",
            reward_weights,
            f"must have one weight per reward ({len(specs)}: {', '.join(specs)})",
        )


def check_iterations(
    objective: str, num_iterations: int, epsilon: float, epsilon_high: float | None
) -> None:
    """GRPO's `num_iterations` and its clip's bounds."""
    require(
        num_iterations >= 1,
        "train",
        "num_iterations",
        num_iterations,
        "must be >= 1 (optimizer steps each sample of completions serves)",
    )
    require(
        0 < epsilon < 1,
        "train",
        "epsilon",
        epsilon,
        "must be in (0, 1): the ratio is clipped to [1 - epsilon, 1 + epsilon_high]",
    )
    require(
        epsilon_high is None or epsilon_high > 0,
        "train",
        "epsilon_high",
        epsilon_high,
        "must be > 0, or null for epsilon",
    )
    if objective != "grpo" and num_iterations != 1:
        raise ConfigError(
            f"train.num_iterations ({num_iterations}) reuses GRPO's sampled completions,"
            f" and this run's objective is {objective}: remove it."
        )


def check_loss_type(
    objective: str,
    loss_type: str | list[str] | None,
    loss_weights: list[float] | str | None,
    label_smoothing: float,
) -> None:
    """`loss_type` against its objective's choices (TRL's names), and DPO's `loss_weights`
    and `label_smoothing`."""
    types = names(loss_type)
    weights = numbers(loss_weights, "train", "loss_weights", "one per loss type")
    choices = LOSS_TYPES.get(objective)
    if loss_type is not None:
        if choices is None:
            raise ConfigError(
                f"train.loss_type ({loss_type!r}) chooses a DPO or GRPO loss, and "
                f"train.objective is {objective!r}: remove train.loss_type."
            )
        require(
            len(types) > 0 and all(types),
            "train",
            "loss_type",
            loss_type,
            f"must name a loss type (null: {choices[0]})",
        )
        require(
            len(types) == 1 or objective == "dpo",
            "train",
            "loss_type",
            loss_type,
            f"names {len(types)} loss types, and {objective} takes one",
        )
        for name in types:
            if name not in choices:
                hint = did_you_mean(name, choices)
                raise ConfigError(
                    f"train.loss_type ({name!r}) is not one of {objective}'s: "
                    f"{', '.join(choices)} (TRL's names; the first is the default).{hint}"
                )
    given = [
        f"train.{key} ({value!r})"
        for key, value, unset in (
            ("loss_weights", loss_weights, weights is None),
            ("label_smoothing", label_smoothing, label_smoothing == 0.0),
        )
        if not unset
    ]
    if objective != "dpo":
        if given:
            raise ConfigError(
                f"{' and '.join(given)} applies to train.objective: dpo (TRL's DPO loss "
                f"types), and this run's objective is {objective}: remove it, or set "
                "train.objective: dpo."
            )
        return
    types = types or [DPO_LOSS_TYPES[0]]
    if weights is not None and len(weights) != len(types):
        raise ConfigError(
            f"train.loss_weights ({loss_weights!r}) has {len(weights)} weight(s) for "
            f"{len(types)} loss type(s) ({', '.join(types)}): give one per loss type, in "
            "the same order, or null for 1.0 each."
        )
    _check_label_smoothing(label_smoothing, types)


def _check_label_smoothing(eps: float, types: list[str]) -> None:
    """`label_smoothing` (`eps`) against the DPO loss types that read it."""
    smoothed = [name for name in types if name in SMOOTHED_LOSS_TYPES]
    if eps != 0.0 and not smoothed:
        raise ConfigError(
            f"train.label_smoothing ({eps}) changes nothing with loss type "
            f"{', '.join(types)}: only {', '.join(SMOOTHED_LOSS_TYPES)} read it (TRL 1.16's "
            "sigmoid has no label smoothing): set loss_type: robust for noisy labels, or "
            "remove label_smoothing."
        )
    require(0 <= eps < 1, "train", "label_smoothing", eps, "must be in [0, 1)")
    require(
        "robust" not in types or eps < 0.5,
        "train",
        "label_smoothing",
        eps,
        "must be below 0.5 with the robust loss: it is the share of flipped labels, and the "
        "loss divides by 1 - 2 * label_smoothing",
    )
    require(
        "exo_pair" not in types or eps > 0,
        "train",
        "label_smoothing",
        eps,
        "must be > 0 with the exo_pair loss: it is EXO's epsilon, whose log the loss takes "
        "(the EXO paper recommends 1e-3)",
    )
