"""GRPO's loss as TRL 1.16 computes it (llmcli/objectives/grpo_loss.py): each
`train.loss_type` and its gradient against TRL's `_compute_loss` written out here, at a sampling
temperature other than 1 and with two micro-batches; a step split 8 x 1 or 4 x 2 computing the
same thing; num_iterations' clipped ratio and exact resume; several rewards; the config's
choices and the objective defaults.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest
import torch
from test_grpo import REWARD, base, grpo_config, objective_for  # noqa: F401 (base: a fixture)

from llmcli.config import config_from_dict
from llmcli.data.prompts import PromptSampler
from llmcli.errors import ConfigError, InputError
from llmcli.objectives.grpo_loss import advantages
from llmcli.objectives.grpo_samples import GRPOStream
from llmcli.objectives.rewards import Rewards
from llmcli.runs.formats import read_weights
from llmcli.runs.metrics import read_metrics
from llmcli.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")


def trl_step_loss(
    model, shares, loss_type: str, temperature: float, max_len: int, accum: int, eps=(0.2, 0.2)
):
    """TRL's `_compute_loss` over a step's micro-batches, summed as its Trainer sums them (the
    loss types but dapo divide by the accumulation steps themselves; dapo divides by the
    step's tokens, `num_items_in_batch`); `old_per_token_logps` the shares' own where they
    keep them (num_iterations > 1), else the policy's detached."""
    step_tokens = sum(s.completions.mask[:, 1:].sum() for s in shares)
    total = 0.0
    for share in shares:
        ids, mask = share.completions.ids, share.completions.mask[:, 1:].float()
        logits = model(ids[:, :-1])[0] / temperature
        logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        old = logps.detach() if share.old_logps is None else share.old_logps
        coef_1 = torch.exp(logps - old)
        coef_2 = torch.clamp(coef_1, 1 - eps[0], 1 + eps[1])
        A = share.advantages[:, None]
        per_token = -torch.min(coef_1 * A, coef_2 * A)
        if loss_type == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
        elif loss_type == "bnpo":
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accum
        elif loss_type == "dr_grpo":
            loss = (per_token * mask).sum() / (per_token.size(0) * max_len) / accum
        else:  # dapo
            loss = (per_token * mask).sum() / step_tokens
        total = total + loss
    return total


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_each_loss_type_and_its_gradient_are_trls_at_a_temperature_with_two_micro_batches(
    base: Path,  # noqa: F811
    tmp_path: Path,
    loss_type: str,
) -> None:
    config = grpo_config(base, tmp_path, grad_accum=2, loss_type=loss_type)
    config = dataclasses.replace(config, sample=dataclasses.replace(config.sample, temperature=0.7))
    objective, model, _, prompts, _ = objective_for(config)
    step = PromptSampler(prompts.train, config.train.batch_size * 2, seed=3).next()
    shares = objective.shares(step, 2)
    assert [len(s.completions.rewards) for s in shares] == [8, 8]
    # The advantages are the whole step's, group by group.
    done = objective.sample(step)
    adv = advantages(done.rewards, config.train.group_size, True)
    torch.testing.assert_close(torch.cat([s.advantages for s in shares]), adv)

    ours = sum(objective(model, share)[0] / 2 for share in shares)  # as train_step sums them
    ours.backward()
    ours_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    theirs = trl_step_loss(model, shares, loss_type, 0.7, config.sample.max_new_tokens, 2)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    assert sum(float(g.abs().sum()) for g in ours_grads) > 0
    for got, p in zip(ours_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)


def test_a_step_split_in_two_micro_batches_computes_what_one_does(
    base: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    runs = {}
    for batch, accum in ((8, 1), (4, 2)):
        folder = tmp_path / f"{batch}x{accum}"
        folder.mkdir()
        config = grpo_config(
            base, folder, batch_size=batch, grad_accum=accum, max_steps=1, eval_interval=1
        )
        train(config, out_dir=folder / "run", progress=False)
        (record,) = [
            r for r in read_metrics(folder / "run" / "metrics.jsonl") if r["kind"] == "train"
        ]
        runs[batch] = record
    one, two = runs[8], runs[4]
    assert one["reward_std"] > 0 and one["grad_norm"] > 0
    for name in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"):
        assert two[name] == pytest.approx(one[name], abs=1e-6), name
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["train_loss"] == pytest.approx(one["train_loss"], abs=1e-6)


def test_loss_type_is_checked_against_the_objectives_choices(base: Path, tmp_path: Path) -> None:  # noqa: F811
    config = grpo_config(base, tmp_path)
    assert config.train.resolved_loss_type == "dapo"  # TRL's default
    with pytest.raises(ConfigError, match=r"not one of grpo's: dapo, bnpo, grpo, dr_grpo.*'bnpo'"):
        grpo_config(base, tmp_path, loss_type="bnp")
    with pytest.raises(
        ConfigError, match="train.objective is 'next_token': remove train.loss_type"
    ):
        config_from_dict({"train": {"loss_type": "dapo"}})
    with pytest.raises(ConfigError, match=r"names 2 loss types, and grpo takes one"):
        grpo_config(base, tmp_path, loss_type=["dapo", "grpo"])


def test_grpo_samples_as_trl_by_default_and_keeps_what_a_config_sets() -> None:
    grpo = {"objective": "grpo", "init_from": "checkpoints/chat"}
    data = {"format": "prompts", "path": "p.jsonl"}
    config = config_from_dict({"data": data, "train": grpo})
    assert (config.sample.temperature, config.sample.top_k, config.sample.top_p) == (1.0, None, 1.0)
    config = config_from_dict({"data": data, "train": grpo, "sample": {"top_k": 5}})
    assert (config.sample.temperature, config.sample.top_k) == (1.0, 5)
    plain = config_from_dict({})  # the other objectives keep sample's own defaults
    assert (plain.sample.temperature, plain.sample.top_k) == (0.8, 200)


def test_dpo_and_grpo_fine_tune_at_their_own_rates_unless_told() -> None:
    def train_of(objective: str, fmt: str, **given: object):
        data = {"format": fmt, "path": "p.jsonl"}
        train = {"objective": objective, "init_from": "checkpoints/chat", **given}
        tc = config_from_dict({"data": data, "train": train}).train
        return tc.lr, tc.min_lr, tc.warmup_steps, tc.eval_interval

    assert train_of("grpo", "prompts") == (1e-4, 1e-5, 10, 50)
    assert train_of("dpo", "preference") == (5e-5, 5e-6, 20, 50)
    assert train_of("dpo", "preference", lr=1e-3, min_lr=1e-4) == (1e-3, 1e-4, 20, 50)
    tc = config_from_dict({}).train  # pretraining's
    assert (tc.lr, tc.min_lr, tc.warmup_steps, tc.eval_interval) == (1e-3, 1e-4, 100, 250)


def test_a_second_iteration_is_ppos_clipped_ratio_against_the_sampling_policy(
    base: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = grpo_config(base, tmp_path, grad_accum=2, num_iterations=2, epsilon_high=0.28)
    objective, model, _, prompts, _ = objective_for(config)
    step = PromptSampler(prompts.train, config.train.batch_size * 2, seed=3).next()
    shares = objective.shares(step, 2)
    # The ratio's denominator is the policy that sampled them, at the sampling temperature.
    for share in shares:
        with torch.no_grad():
            logits = model(share.completions.ids[:, :-1])[0] / config.sample.temperature
        logps = torch.log_softmax(logits, -1).gather(-1, share.completions.ids[:, 1:, None])
        torch.testing.assert_close(share.old_logps, logps[..., 0])
    with torch.no_grad():  # an update moved the policy: the ratio leaves 1, the clip acts
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    results = [objective(model, share) for share in shares]
    ours = sum(loss / 2 for loss, _ in results)
    ours.backward()
    ours_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    theirs = trl_step_loss(model, shares, "dapo", 1.0, 8, 2, eps=(0.2, 0.28))
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    for got, p in zip(ours_grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)
    clipped = [float(figures["clip_ratio/region_mean"]) for _, figures in results]
    assert max(clipped) > 0


def test_num_iterations_serves_each_sample_that_many_steps_and_resumes_exactly(
    base: Path,  # noqa: F811
    tmp_path: Path,
    ctrl_c_raises,
) -> None:
    config = grpo_config(base, tmp_path, max_steps=4, eval_interval=4, num_iterations=2)
    straight = tmp_path / "straight"
    train(config, out_dir=straight, progress=False)
    records = [r for r in read_metrics(straight / "metrics.jsonl") if r["kind"] == "train"]
    # Steps 1 and 2 read one sample (the same rewards), steps 3 and 4 the next.
    assert records[0]["reward"] == records[1]["reward"] != records[2]["reward"]
    assert records[2]["reward"] == records[3]["reward"]
    assert "clip_ratio/region_mean" in records[1]

    def interrupt(step: int) -> None:
        if step == 1:  # a save between the two steps of one sample
            signal.raise_signal(signal.SIGINT)

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(config, out_dir=resumed, progress=False, on_step=interrupt)
    summary = train(config, out_dir=resumed, resume=True, progress=False)
    assert summary.resumed_from == 1 and summary.step == 4
    a, b = (read_weights(run / "model.safetensors")[0] for run in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_num_iterations_is_grpos_and_its_clip_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"train.num_iterations \(2\) reuses GRPO's"):
        config_from_dict({"train": {"num_iterations": 2}})
    with pytest.raises(ConfigError, match=r"train.epsilon \(1.5\) must be in \(0, 1\)"):
        config_from_dict({"train": {"epsilon": 1.5}})


def test_several_rewards_are_summed_with_their_weights_and_each_logged(
    base: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "rewards.py").write_text(REWARD)
    specs = [f"{tmp_path / 'rewards.py'}:score", "contains"]
    config = grpo_config(base, tmp_path, reward=specs, reward_weights=[1.0, 0.5])
    objective, _, sampler, prompts, _ = objective_for(config)
    batch = sampler.next()
    done = objective.sample(batch)
    G = config.train.group_size
    answers = [prompts.train.answers[k] for k in batch.picks for _ in range(G)]
    own = torch.tensor([t.count("a") + len(t) / 8 for t in done.texts])
    found = torch.tensor([float(a in t) for a, t in zip(answers, done.texts, strict=True)])
    torch.testing.assert_close(done.rewards, own + 0.5 * found)
    (share,) = objective.shares(batch, 1)
    assert float(share.figures["rewards/score/mean"]) == pytest.approx(float(own.mean()))
    assert float(share.figures["rewards/contains/std"]) == pytest.approx(float(found.std()))
    with pytest.raises(ConfigError, match=r"must have one weight per reward \(2: "):
        grpo_config(base, tmp_path, reward=specs, reward_weights=[1.0])
    with pytest.raises(ConfigError, match="weighs GRPO's rewards"):
        config_from_dict({"train": {"reward_weights": [1.0]}})


def test_a_smaller_micro_batch_after_running_out_of_memory_splits_the_next_step_in_more_parts(
    base: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = grpo_config(base, tmp_path, batch_size=4)
    objective, _, _, prompts, _ = objective_for(config)
    stream = GRPOStream(objective, PromptSampler(prompts.train, 4, seed=3), parts=1)
    assert stream.batch_size == 4 and len(stream.next().completions.rewards) == 16
    stream.batch_size = 2  # as llmcli.training.batch.shrink_micro_batch tells the sampler
    first, second = stream.next(), stream.next()
    G = config.train.group_size
    assert len(first.completions.rewards) == len(second.completions.rewards) == 2 * G
    assert first.step_tokens == second.step_tokens  # one step's dapo normaliser, halved
    tokens = first.completions.mask[:, 1:].sum() + second.completions.mask[:, 1:].sum()
    assert first.step_tokens == pytest.approx(float(tokens) / 2)


def test_the_sampling_policys_log_probabilities_are_taken_in_the_steps_precision(
    base: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Under bf16 autocast (a GPU run's), the first update of a reused sample has a ratio of 1
    exactly: its denominator was computed in the step's precision, not in float32."""
    config = grpo_config(base, tmp_path, num_iterations=2)
    objective, model, sampler, _, _ = objective_for(config)
    objective.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    (share,) = objective.shares(sampler.next(), 1)
    with objective.autocast():
        loss, _ = objective(model, share)
    m = share.completions.mask[:, 1:].float()
    assert float(loss.detach()) == pytest.approx(
        float(-(share.advantages[:, None] * m).sum() / m.sum()), abs=1e-6
    )


def test_several_rewards_weigh_each_functions_checked_score() -> None:
    """`Rewards.total`, what evaluations score replies with: the weighted sum of the scores,
    each checked as a single reward's is (a text "1" is refused, not summed as 1)."""
    rewards = Rewards([("one", lambda p, c, a: 1), ("two", lambda p, c, a: 2.0)], [1.0, 0.25])
    assert rewards.total("p", "c", None, "row 1") == 1.5
    text = Rewards([("one", lambda p, c, a: 1), ("text", lambda p, c, a: "1")], [1.0, 1.0])
    with pytest.raises(InputError, match=r"gave '1', not a finite number.*at row 3"):
        text.total("p", "c", None, "row 3")
