"""GRPO (`train.objective: grpo`; llmcli/objectives/grpo.py, rewards.py, llmcli/data/prompts.py):
one step's loss against the formula written out on its own completions, rewards and
log-probabilities; the KL penalty; the verifiers on GSM8K's answers; the evaluation's pass@1
against greedy replies made apart, and scored with the run's reward; a resumed run bitwise the
uninterrupted one; bad input, a reward that never returns and greedy sampling through the CLI.

The base is a 1-layer chat model of width 16 (context 32), so a run takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_helpers import save_chat_run

from llmcli.cli import main
from llmcli.config import Config, config_from_dict, dump_yaml
from llmcli.data.prompts import PromptSampler, prompt_token_data
from llmcli.evaluation import prompts as prompts_module
from llmcli.evaluation.chat import greedy_replies
from llmcli.evaluation.prompts import evaluate_prompts
from llmcli.model.gpt import Transformer
from llmcli.objectives.base import init_encoding
from llmcli.objectives.grpo import GRPOObjective
from llmcli.objectives.grpo_loss import advantages
from llmcli.objectives.rewards import contains, exact, load_rewards, number, parse_number
from llmcli.runs.compare import compare_runs, format_table
from llmcli.runs.formats import read_weights
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import read_metrics
from llmcli.training.init_from import load_init_weights, resolve_init_from
from llmcli.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")

LETTERS = "abcdefghijklmnopqrstuvwxyz"
# A reward with many values, so that every group has a spread to learn from.
REWARD = (
    "def score(prompt, completion, answer):\n"
    "    return completion.count('a') + len(completion) / 8\n"
)


def row(i: int, answer: bool = True) -> dict:
    a, b = LETTERS[i % 26], LETTERS[(5 * i + 2) % 26]
    prompt = [{"role": "user", "content": f"spell {a}{b}"}]
    return {"prompt": prompt, "answer": f"{a}-{b}"} if answer else {"prompt": prompt}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grpo")
    return save_chat_run(folder / "base", n_layer=1, n_embed=16, context_length=32)


def grpo_config(base: Path, folder: Path, reward: str | None = None, **train: object) -> Config:
    if reward is None:
        reward = f"{folder / 'rewards.py'}:score"
        (folder / "rewards.py").write_text(REWARD)
    raw = {
        "model": {"dropout": 0.0},
        "data": {
            "format": "prompts",
            "path": str(write_rows(folder / "train.jsonl", [row(i) for i in range(12)])),
            "val_path": str(write_rows(folder / "val.jsonl", [row(i) for i in range(12, 16)])),
        },
        "train": {
            "objective": "grpo",
            "init_from": str(base),
            "reward": reward,
            "group_size": 4,
            "device": "cpu",
            "batch_size": 2,
            "max_steps": 4,
            "warmup_steps": 1,
            "lr": 1e-3,
            "min_lr": 1e-3,
            "eval_interval": 2,
            "eval_steps": 2,
            "log_interval": 1,
            "seed": 7,
            **train,
        },
        "sample": {"max_new_tokens": 8, "temperature": 1.0},
    }
    return resolve_init_from(config_from_dict(raw, name="grpo"))


def objective_for(config: Config, reference: torch.nn.Module | None = None):
    tokenizer, template = init_encoding(config)
    data = prompt_token_data(config.data, config.model.context_length, tokenizer, template)
    model = Transformer(config.model, tokenizer.vocab_size)
    load_init_weights(model, config.train.init_from)
    reward = load_rewards(config.train.reward_specs, config.train.reward_weight_values)
    objective = GRPOObjective(model, data.prompts, config, reward, tokenizer.decode, reference)
    sampler = PromptSampler(data.prompts.train, config.train.batch_size, seed=3)
    return objective, model, sampler, data.prompts, tokenizer


def hand_logps(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """Each next token's log-probability, from the logits in float64 NumPy."""
    with torch.no_grad():
        logits = model(ids[:, :-1])[0].double().numpy()  # (R, L-1, V)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, ids[:, 1:, None].numpy(), -1)[..., 0]
    return picked - logz  # (R, L-1)


def test_a_steps_loss_is_the_formula_on_its_own_completions_rewards_and_logps(
    base: Path, tmp_path: Path
) -> None:
    config = grpo_config(base, tmp_path)
    objective, model, sampler, prompts, tokenizer = objective_for(config)
    batch = sampler.next()
    done = objective.sample(batch)  # the step's own completions: drawn from the batch's seed
    (share,) = objective.shares(batch, 1)
    assert torch.equal(share.completions.ids, done.ids) and share.completions.texts == done.texts
    loss, metrics = objective(model, share)
    G = config.train.group_size
    # Each row is its prompt, the completion drawn, and the end token when it ended.
    read = 0  # positions the model reads: each row's tokens but its last, no padding
    for i, k in enumerate(r for r in batch.picks for _ in range(G)):
        n = len(prompts.train.ids[k])
        assert done.ids[i, :n].tolist() == prompts.train.ids[k].tolist()
        completion = done.ids[i][done.mask[i]].tolist()
        read += n + len(completion) - 1
        if done.ended[i]:  # at one of the tokens that end a reply, the row's last
            assert completion[-1] in prompts.end_ids
            completion = completion[:-1]
        else:
            assert not set(completion) & set(prompts.end_ids)
        assert tokenizer.decode(completion) == done.texts[i]
    assert done.positions == read < done.ids.numel()  # the log's tokens
    rewards = np.array([t.count("a") + len(t) / 8 for t in done.texts])
    assert np.allclose(done.rewards.numpy(), rewards)
    assert rewards.reshape(-1, G).std(axis=1).min() > 0  # every group has something to learn

    groups = rewards.reshape(-1, G)
    adv = (
        (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    ).ravel()
    m = done.mask[:, 1:].numpy()
    # TRL's value: the ratio is 1, so the loss is the token-weighted mean of -A (dapo).
    assert loss.item() == pytest.approx(-(adv[:, None] * m).sum() / m.sum(), rel=1e-5, abs=1e-6)
    assert float(metrics["reward"]) == pytest.approx(rewards.mean(), rel=1e-6)
    assert float(metrics["reward_std"]) == pytest.approx(rewards.std(ddof=1), rel=1e-5)
    lengths = done.mask.sum(1).float()
    assert float(metrics["completions/mean_length"]) == pytest.approx(lengths.mean())
    assert float(metrics["completions/max_length"]) == lengths.max()
    assert float(metrics["frac_reward_zero_std"]) == 0.0
    assert float(metrics["completions/clipped_ratio"]) == pytest.approx(
        1 - done.ended.float().mean()
    )
    # Its gradient is the policy gradient's: -sum A log p over the completion tokens / tokens.
    loss.backward()
    got = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(done.ids[:, :-1])[0]
    logp = torch.log_softmax(logits, -1).gather(-1, done.ids[:, 1:, None])[..., 0]
    (
        -(torch.tensor(adv, dtype=torch.float32)[:, None] * logp * done.mask[:, 1:]).sum() / m.sum()
    ).backward()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, model.lm_head.weight.grad, rtol=1e-4, atol=1e-7)


def test_the_kl_penalty_is_trls_estimate_against_the_reference(base: Path, tmp_path: Path) -> None:
    config = grpo_config(base, tmp_path, grpo_beta=0.5)
    reference = Transformer(config.model, int(init_encoding(config)[0].vocab_size))
    load_init_weights(reference, config.train.init_from)
    objective, model, sampler, _, _ = objective_for(config, reference.eval())
    with torch.no_grad():  # the policy moved away from the reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    (share,) = objective.shares(sampler.next(), 1)
    done = share.completions
    loss, metrics = objective(model, share)
    m = done.mask[:, 1:].numpy()
    diff = hand_logps(reference, done.ids) - hand_logps(model, done.ids)
    kl = ((np.exp(diff) - diff - 1) * m).sum() / m.sum()
    adv = advantages(done.rewards, config.train.group_size, True).double().numpy()
    pg = -(adv[:, None] * m).sum() / m.sum()
    assert kl > 0 and float(metrics["kl"]) == pytest.approx(kl, rel=1e-4)
    assert float(loss.detach()) == pytest.approx(pg + 0.5 * kl, rel=1e-4, abs=1e-6)


# GSM8K's first training row's answer (openai/grade-school-math, train.jsonl line 1).
GSM8K = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
    "clips altogether in April and May.\n#### 72"
)


def test_the_verifiers() -> None:
    assert exact("", " a-b\n", "a-b") == 1.0 and exact("", "a-b-c", "a-b") == 0.0
    assert exact("", "anything", None) == 0.0
    assert number("", "so x = 1,234.", "1234") == 1.0 and number("", "42 or 43", "42") == 0.0
    assert number("", "-3.50", "-3.5") == 1.0 and number("", "none", "3") == 0.0
    assert contains("", "it is a-b indeed", "a-b") == 1.0 and contains("", "a b", "a-b") == 0.0


@pytest.mark.parametrize(
    "reply, answer, expected",
    [
        ("The answer is 72.", GSM8K, 1.0),
        ("#### 72", GSM8K, 1.0),
        ("\\boxed{72}", GSM8K, 1.0),
        ("72.0", GSM8K, 1.0),
        ("She sold 48 + 24 = 72 clips.\n#### 72\nI hope this helps with 3 more.", GSM8K, 1.0),
        ("So \\boxed{72} clips, from 48 and 24.", GSM8K, 1.0),
        ("The answer is 24.", GSM8K, 0.0),
        ("#### 73", GSM8K, 0.0),
        ("7,200", "7200", 1.0),
        ("$1,234.50 in all", "1,234.5", 1.0),
        ("-3", "3", 0.0),
        ("x = \u22123", "-3", 1.0),
        ("no number", "3", 0.0),
        ("no number", GSM8K, 0.0),
        ("72", "seventy-two", 0.0),
    ],
)
def test_number_reads_gsm8k_answers_boxes_and_the_last_number(
    reply: str, answer: str, expected: float
) -> None:
    assert number("", reply, answer) == expected


def test_parse_number_is_the_exact_value_of_the_answer_given() -> None:
    assert parse_number(GSM8K) == 72  # what follows "####", not the reasoning's last number
    assert parse_number("1,234") == 1234 and parse_number("-3.5") == Fraction(-7, 2)
    assert parse_number("x = 42.") == 42 and parse_number("0.1") == Fraction(1, 10)
    assert parse_number("\\boxed{\\text{x} = 5} then 6") == 5  # the box, not the last number
    assert parse_number("\\boxed{12") == 12  # a box cut at the budget
    assert parse_number("#### 5, then 6") == 5 and parse_number("a-3") == 3
    assert parse_number("1, 2, 3") == 3 and parse_number("v1.5.3 or x2") is None
    assert parse_number("no number") is None and parse_number("\\boxed{none} 4") is None


def test_evaluation_reports_greedy_pass_at_1_as_the_replies_made_apart(
    base: Path, tmp_path: Path, capsys
) -> None:
    config = grpo_config(base, tmp_path, reward="exact")
    objective, model, _, prompts, tokenizer = objective_for(config)
    split = prompts.val
    figures = objective.evaluate(split, limit=len(split))
    model.eval()
    budgets = [min(config.sample.max_new_tokens, 32 + 1 - len(ids)) for ids in split.ids]
    got = [
        greedy_replies(model, [ids.tolist()], [n], prompts.end_ids, config.sample)[0]
        for ids, n in zip(split.ids, budgets, strict=True)
    ]
    texts = [tokenizer.decode(ids) for ids, _ in got]
    passes = [t.strip() == a for t, a in zip(texts, split.answers, strict=True)]
    assert figures["pass@1"] == pytest.approx(sum(passes) / len(passes))
    assert figures["reward"] == figures["pass@1"]  # exact: the reward is the pass

    # llmcli eval on the prompts file answers them alike, on any chat run (with its own
    # sampling settings: its max_new_tokens)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--checkpoint", str(base), "--data", config.data.val_path, "--json"])
    assert exit_.value.code in (0, None)
    result = json.loads(capsys.readouterr().out)
    n = load_run(base).config.sample.max_new_tokens
    got = [
        greedy_replies(
            model, [ids.tolist()], [min(n, 33 - len(ids))], prompts.end_ids, config.sample
        )
        for ids in split.ids
    ]
    assert [r["reply"] for r in result["per_prompt"]] == [tokenizer.decode(g[0][0]) for g in got]
    assert result["prompts"] == len(split) and result["reward_name"] == "exact"


def numbered(i: int, answer: str) -> dict:
    return {**row(i), "answer": answer}


def test_evaluation_scores_with_the_runs_reward_where_exact_match_would_not(
    base: Path, tmp_path: Path, monkeypatch
) -> None:
    # Replies written for the test (the tiny model's characters hold no digits) stand for the
    # greedy replies' text: under `number` three of four pass, as exact match passes one.
    answers = [GSM8K, "1,234", "3", "#### 5"]
    replies = ["The answer is 72.", "1234", "-3", "#### 5"]
    config = grpo_config(base, tmp_path, reward="number", max_steps=1, eval_interval=1)
    write_rows(Path(config.data.path), [numbered(i, "#### 1") for i in range(12)])
    val = write_rows(
        Path(config.data.val_path), [numbered(12 + i, a) for i, a in enumerate(answers)]
    )

    objective, _, _, prompts, _ = objective_for(config)
    objective.decode_text = lambda ids, texts=iter(replies): next(texts)
    assert objective.evaluate(prompts.val, limit=4) == {"reward": 0.75, "pass@1": 0.75}

    # llmcli eval on the prompts file: a GRPO run's reward (number), else exact match.
    greedy_figures = prompts_module.greedy_figures

    def written_replies(model, split, end_ids, sample, reward, decode_text, *args, **kwargs):
        texts = iter(replies)
        return greedy_figures(
            model, split, end_ids, sample, reward, lambda ids: next(texts), *args, **kwargs
        )

    monkeypatch.setattr(prompts_module, "greedy_figures", written_replies)
    train(config, out_dir=tmp_path / "run", progress=False)
    results = [evaluate_prompts(load_run(r), val, 2).to_dict() for r in (tmp_path / "run", base)]
    assert [r["reward_name"] for r in results] == ["number", "exact"]
    assert [(r["passed"], r["answered"], r["pass@1"]) for r in results] == [
        (3, 4, 0.75),
        (1, 4, 0.25),
    ]
    assert [r["reply"] for r in results[0]["per_prompt"]] == replies
    assert [r["reward"] for r in results[0]["per_prompt"]] == [1.0, 1.0, 0.0, 1.0]


def test_a_resumed_grpo_run_is_bitwise_the_uninterrupted_one(
    base: Path, tmp_path: Path, ctrl_c_raises
) -> None:
    # Dropout on: the resumed run draws the masks, prompts and completions the other drew.
    config = grpo_config(base, tmp_path, max_steps=6, eval_interval=3, grad_accum=2)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.1))
    straight = tmp_path / "straight"
    train(config, out_dir=straight, progress=False)

    def interrupt(step: int) -> None:
        if step == 3:  # a Ctrl-C at an evaluation step: it runs when the run resumes
            signal.raise_signal(signal.SIGINT)

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(config, out_dir=resumed, progress=False, on_step=interrupt)
    summary = train(config, out_dir=resumed, resume=True, progress=False)
    assert summary.resumed_from == 3 and summary.step == 6
    a, b = (read_weights(run / "model.safetensors")[0] for run in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)
    drop = ("elapsed_s", "tok_per_s", "mfu")
    records = [
        [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run / "metrics.jsonl")]
        for run in (straight, resumed)
    ]
    assert records[0] == records[1]
    train_records = [r for r in records[0] if r["kind"] == "train"]
    assert len(train_records) == 6 and all("reward_std" in r for r in train_records)
    evals = [r for r in records[0] if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all("val_pass@1" in r for r in evals)
    assert all(r["val_loss"] == -r["val_reward"] for r in evals)


def cli(capsys, *args: object) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["train", *map(str, args), "--no-progress"])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "reward, rows, message",
    [
        ("missing.py:score", None, "train.reward: the file 'missing.py' does not exist"),
        ("rewards.py:nope", None, "has no function 'nope' (it defines: raises, score, text)"),
        ("rewards.py:raises", None, "train.reward raised ZeroDivisionError: division by zero, "),
        ("rewards.py:text", None, "train.reward gave 'good', not a finite number, for the "),
        ("exact", [row(0), row(1, answer=False)], "line 2: the prompt has no answer for "),
        (
            "number",
            [numbered(0, GSM8K), numbered(1, "seventy-two")],
            "train.jsonl line 2: the answer 'seventy-two' holds no number for train.reward "
            "'number' to compare replies with (6 such rows): give the number",
        ),
    ],
)
def test_bad_rewards_and_prompts_exit_2_naming_the_fix_and_write_nothing(
    base: Path, tmp_path: Path, capsys, monkeypatch, reward: str, rows, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(
        REWARD + "def raises(p, c, a):\n    return 1 / 0\ndef text(p, c, a):\n    return 'good'\n"
    )
    config = grpo_config(base, tmp_path, reward=reward)
    if rows is not None:
        write_rows(Path(config.data.path), rows * 6)
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(dump_yaml(config))
    status, err = cli(capsys, config_file, "--out", tmp_path / "run")
    assert status == 2 and "Traceback" not in err, err
    assert message in err, err
    assert not (tmp_path / "run").exists()


def test_a_group_of_one_exits_2(base: Path, tmp_path: Path, capsys) -> None:
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(dump_yaml(grpo_config(base, tmp_path)))
    status, err = cli(capsys, config_file, "--set", "train.group_size=1")
    assert status == 2 and "train.group_size (1) must be >= 2" in err, err


def test_a_run_whose_groups_all_tie_says_so_and_info_shows_its_reward_and_pass_at_1(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    # Every completion gets the same reward: every advantage is 0, the gradient is 0, and the
    # terminal says so with what to change, once three log steps in a row learned nothing.
    (tmp_path / "flat.py").write_text("def score(prompt, completion, answer):\n    return 0.5\n")
    config = grpo_config(base, tmp_path, reward=f"{tmp_path / 'flat.py'}:score")
    with caplog.at_level("INFO"):
        train(config, out_dir=tmp_path / "run", progress=False)
    warned = [r.getMessage() for r in caplog.records if "nothing learned" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "steps 1..3" in warned[0] and "frac_reward_zero_std 1.0" in warned[0]
    assert "Raise sample.temperature or train.group_size" in warned[0]
    evals = [r.getMessage() for r in caplog.records if "val loss" in r.getMessage()]
    assert "(greedy on all 4 validation prompts: val reward 0.500, pass@1 0.0%)" in evals[-1]
    # `llmcli info` shows the reward and pass@1 at the best evaluation, not a negated reward.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--checkpoint", str(tmp_path / "run")])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "best val loss" not in out, out
    assert "best evaluation" in out and "val reward 0.5000, val pass@1 0.0% at step 2" in out, out
    # ... and so does `llmcli compare`, beside the loss it leaves out.
    run = str(tmp_path / "run")
    comparison = compare_runs([run, run])
    assert comparison.runs[0].best_val_loss is None
    assert comparison.runs[0].best_figures == {"val_reward": 0.5, "val_pass@1": 0.0}
    assert "val reward 0.5000, val pass@1 0.0%" in format_table(comparison)


def test_a_group_size_that_cannot_fit_exits_2_before_writing_the_run(
    base: Path, tmp_path: Path, capsys
) -> None:
    # The memory check sizes a step as it runs: batch_size x group_size rows (and the sampling
    # of them all), so a group this large is refused before the run folder is made.
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(dump_yaml(grpo_config(base, tmp_path)))
    huge = "train.group_size=1000000"
    status, err = cli(capsys, config_file, "--set", huge, "--out", tmp_path / "run")
    assert status == 2 and "Traceback" not in err, err
    assert "2 prompts (1,000,000 completions each), 2,000,000 rows" in err, err
    assert "lower train.group_size" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "sample.temperature=0",
            "sample.temperature (0) is greedy decoding, so the train.group_size replies GRPO "
            "samples to a prompt would all be the same: their rewards equal, every advantage "
            "zero, and nothing learned. Set sample.temperature: 1.0 (TRL's default).",
        ),
        ("train.reward_timeout=0", "train.reward_timeout (0.0) must be a number of seconds > 0"),
    ],
)
def test_greedy_sampling_and_a_timeout_of_zero_exit_2(
    base: Path, tmp_path: Path, capsys, setting: str, message: str
) -> None:
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(dump_yaml(grpo_config(base, tmp_path)))
    status, err = cli(capsys, config_file, "--set", setting)
    assert status == 2 and message in err, err


# A reward that never returns from its (1 + hang_after)-th call.
HANGS = """import time
calls = 0
def score(prompt, completion, answer):
    global calls
    calls += 1
    while calls > {hang_after}:
        time.sleep(60)
    return len(completion) / 8
"""


@pytest.mark.parametrize("hang_after", [0, 30])
def test_a_reward_past_its_timeout_stops_the_run_naming_the_prompt(
    base: Path, tmp_path: Path, capsys, monkeypatch, hang_after: int
) -> None:
    # 30 calls: the check before the first step, 8 replies in each of steps 1 and 2, 8 greedy
    # replies at step 2's evaluation, then 5 of step 3's 8.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hangs.py").write_text(HANGS.format(hang_after=hang_after))
    config = grpo_config(base, tmp_path, reward="hangs.py:score", reward_timeout=0.5)
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(dump_yaml(config))
    t0 = time.perf_counter()
    status, err = cli(capsys, config_file, "--out", tmp_path / "run")
    assert time.perf_counter() - t0 < 60  # 0.5 s per call at most, and no wait for the call
    assert status == 2 and "Traceback" not in err, err
    assert "train.reward gave no result within train.reward_timeout (0.5 s), scoring the " in err
    assert "of the prompt at " in err and "train.jsonl line " in err, err
    assert ": fix the function so that it returns, or raise train.reward_timeout" in err, err
    if hang_after == 0:  # found before the first step, on an empty completion: nothing written
        assert "scoring the completion '' of the prompt at " in err
        assert not (tmp_path / "run").exists()
    else:  # the run stopped at step 3: its save at step 2 is whole
        assert load_run(tmp_path / "run").step == 2
