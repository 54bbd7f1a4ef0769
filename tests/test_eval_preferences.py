"""`llmcli eval` on preference pairs (llmcli/evaluation/preferences.py).

References: each pair scored alone by a plain forward of the run's model and of its reference,
the log-probabilities of the completion tokens summed in float64 NumPy, and DPO's loss and
TRL's metrics written out over them; and TRL's own `DPOTrainer.evaluate` on the runs'
Hugging Face exports (llmcli export) and the same rows.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from chat_helpers import chat_tokenizer, save_chat_run
from conftest import save_tiny_run
from hf_helpers import make_run

from llmcli.cli import main
from llmcli.config.objective_settings import DPO_LOSS_TYPES, SMOOTHED_LOSS_TYPES
from llmcli.data.chat_template import default_template
from llmcli.data.preferences import PreferenceEncoder, read_preferences
from llmcli.evaluation.run import EvalOptions, evaluate_run
from llmcli.runs.loading import load_run
from llmcli.training.init_from import reference_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 64}
BETA = 0.5
TRL_NAMES = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def conversational(i: int, rejected: str = "no idea") -> dict:
    a, b = LETTERS[i % 26], LETTERS[(3 * i + 1) % 26]
    return {
        "prompt": [{"role": "user", "content": f"spell {a}{b}"}],
        "chosen": [{"role": "assistant", "content": f"{a}-{b}"}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def text(i: int) -> dict:
    a, b = LETTERS[(7 * i) % 26], LETTERS[(5 * i + 2) % 26]
    chosen = [f" {a}-{b}.", f" {a}{b}!", f"{a} {b}"][i % 3]
    rejected = [f" {b}{a}?", "no", f" {b}-{a}", "?"][i % 4]
    return {"prompt": f"Spell {a}{b}:", "chosen": chosen, "rejected": rejected}


CONVERSATIONAL = [conversational(i, ["no idea", "nope", "x", "I cannot."][i % 4]) for i in range(7)]
TEXT = [text(i) for i in range(6)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A chat run, a DPO run from it (its own weights, as if trained) and files of pairs."""
    root = tmp_path_factory.mktemp("pairs")
    base = save_chat_run(root / "base", **MODEL)
    train = write_jsonl(root / "train.jsonl", [conversational(i) for i in range(8)])
    val = write_jsonl(root / "val.jsonl", CONVERSATIONAL[:3])
    raw = {
        "model": MODEL,
        "data": {"format": "preference", "path": str(train), "val_path": str(val)},
        "train": {"objective": "dpo", "init_from": str(base.resolve()), "dpo_beta": BETA},
    }
    dpo = save_tiny_run(root / "dpo", chat_tokenizer(), raw, seed=1, sharpen=3.0)
    default_template().save(dpo)
    return {
        "root": root,
        "base": base,
        "dpo": dpo,
        "val": val,
        "conversational": write_jsonl(root / "conversational.jsonl", CONVERSATIONAL),
        "text": write_jsonl(root / "text.jsonl", TEXT),
    }


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def run_eval(capsys, run_dir: Path, *options) -> tuple[int, str, str]:
    return cli(capsys, "eval", "--checkpoint", run_dir, "--no-progress", *options)


def evaluate(run_dir: Path, data: Path | None, **options):
    return evaluate_run(
        run_dir, data, EvalOptions(device="cpu", **options), load_reference=reference_model
    )


def hand_logps(model: torch.nn.Module, prompt: np.ndarray, completion: np.ndarray) -> float:
    """One sequence alone: its completion tokens' log-probabilities, in float64, summed."""
    ids = np.concatenate([prompt, completion])
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(ids[:-1])[None])  # (1, N - 1, V)
    logits = logits[0].double().numpy()
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    logp = logits[np.arange(len(ids) - 1), ids[1:]] - logz  # (N - 1,): token t + 1's
    return float(logp[len(prompt) - 1 :].sum())


def hand_figures(policy_dir: Path, reference_dir: Path, data: Path) -> dict[str, float]:
    """Every pair of `data` that fits the context, by hand, and the figures over them."""
    policy, reference = load_run(policy_dir), load_run(reference_dir)
    encoder = PreferenceEncoder(policy.tokenizer, default_template())
    room = MODEL["context_length"] + 1
    scores = []  # (policy chosen, policy rejected, reference chosen, reference rejected)
    for pair in map(encoder.encode, read_preferences(data)):
        keep = room - len(pair.prompt)  # what is left of each completion in the window
        if keep < 1:
            continue
        replies = (pair.chosen[:keep], pair.rejected[:keep])
        scores.append(
            [hand_logps(m.model, pair.prompt, r) for m in (policy, reference) for r in replies]
        )
    pc, pr, rc, rr = np.asarray(scores).T
    chosen, rejected = BETA * (pc - rc), BETA * (pr - rr)
    return {
        "loss": float(np.mean(np.logaddexp(0.0, -(chosen - rejected)))),
        "rewards/accuracies": float(np.mean(chosen > rejected)),
        "rewards/margins": float(np.mean(chosen - rejected)),
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "logps/chosen": float(pc.mean()),
        "logps/rejected": float(pr.mean()),
        "logps/accuracies": float(np.mean(pc > pr)),
    }


def test_pairs_score_as_each_pair_alone_by_hand_whatever_the_batch(runs, tmp_path):
    long_prompt = conversational(0) | {"prompt": [{"role": "user", "content": "x" * 70}]}
    long_reply = conversational(1) | {"chosen": [{"role": "assistant", "content": "y" * 70}]}
    rows = [*CONVERSATIONAL[:4], long_prompt, long_reply, *CONVERSATIONAL[4:]]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    expected = hand_figures(runs["dpo"], runs["base"], data)
    assert 0 < expected["rewards/accuracies"] < 1 and 0 < expected["logps/accuracies"] < 1

    result = evaluate(runs["dpo"], data, batch_size=3)
    got = result.to_dict()
    assert got["reference"] == str(runs["base"].resolve()) and got["beta"] == BETA
    assert (got["pairs"], got["truncated"], got["skipped"]) == (8, 1, 1)
    assert got["skipped_at"] == [f"{data} line 5"]
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-5), name
    by_pair = got["per_pair"]
    assert by_pair[4]["where"] == f"{data} line 6" and by_pair[4]["truncated"]

    # Padding a batch to its longest pair changes no pair's score: any batch size, one figure.
    for batch_size in (1, 8):
        other = evaluate(runs["dpo"], data, batch_size=batch_size).to_dict()
        for name in expected:
            assert other[name] == pytest.approx(got[name], abs=1e-5), name
    # --steps: the first batches only, in order.
    first = evaluate(runs["dpo"], data, batch_size=3, steps=1).to_dict()
    assert first["pairs"] == 3 and first["per_pair"] == by_pair[:3]


def test_without_data_a_dpo_run_scores_its_validation_pairs(runs, capsys):
    code, out, err = run_eval(capsys, runs["dpo"], "--json")
    assert code == 0, err
    split = json.loads(out)
    counts = ("pairs", "truncated", "skipped", "skipped_at")
    assert {*TRL_NAMES, "logps/accuracies", *counts, "reference", "beta", "per_pair"} <= set(split)
    assert split["data"] == f"validation pairs of {runs['val']}" and split["pairs"] == 3
    code, out, err = run_eval(capsys, runs["dpo"], "--data", runs["val"], "--json")
    assert code == 0, err
    given = json.loads(out)
    for name in (*TRL_NAMES, "logps/accuracies"):
        assert split[name] == pytest.approx(given[name], abs=1e-6), name
    assert_records_close(split["per_pair"], given["per_pair"], abs=1e-6)


def assert_records_close(got: list[dict], expected: list[dict], abs: float) -> None:
    """Records equal field by field: numbers within `abs`, everything else exactly (pytest 9's
    `approx` refuses a list of dicts)."""
    assert len(got) == len(expected)
    for i, (record, reference) in enumerate(zip(got, expected, strict=True)):
        assert record.keys() == reference.keys(), i
        for key, value in record.items():
            numeric = isinstance(value, float) and not isinstance(reference[key], bool)
            if numeric:
                assert value == pytest.approx(reference[key], abs=abs), (i, key)
            else:
                assert value == reference[key], (i, key)


def test_a_run_not_trained_with_dpo_ranks_the_replies_itself_and_takes_a_reference(runs, capsys):
    code, out, err = run_eval(capsys, runs["base"], "--data", runs["conversational"], "--json")
    assert code == 0, err
    alone = json.loads(out)
    assert alone["reference"] is None and alone["loss"] is None
    assert all(alone[name] is None for name in TRL_NAMES if name.startswith("rewards/"))
    assert alone["per_pair"][0]["ref_chosen_logps"] is None
    by_hand = hand_figures(runs["base"], runs["base"], runs["conversational"])
    for name in ("logps/chosen", "logps/rejected", "logps/accuracies"):
        assert alone[name] == pytest.approx(by_hand[name], abs=1e-5), name

    # Against itself: every reward 0, so the loss is log 2 and no pair is won.
    code, out, err = run_eval(
        capsys, runs["base"], "--data", runs["conversational"], "--reference", runs["base"]
    )
    assert code == 0, err
    assert f"DPO loss {math.log(2):.4f}, reward accuracy 0.0%, margin +0.0000" in out
    assert "no reference" not in out
    code, out, err = run_eval(capsys, runs["base"], "--data", runs["conversational"])
    assert code == 0 and "no reference: --reference RUN" in out


def test_bad_input_exits_2_naming_what_to_fix(runs, tmp_path, capsys):
    def refused(run_dir: Path, *options: object) -> str:
        code, out, err = run_eval(capsys, run_dir, *options)
        assert code == 2, (out, err)
        assert "Traceback" not in err
        return " ".join(err.split())

    broken = write_jsonl(tmp_path / "broken.jsonl", [CONVERSATIONAL[0], {"prompt": "a"}])
    err = refused(runs["dpo"], "--data", broken)
    assert f"{broken} line 2" in err and "'chosen', 'rejected'" in err
    # On a DPO run any .jsonl file is pairs, so a row of another shape is named as such.
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "hello"}])
    assert f"{other} line 1" in refused(runs["dpo"], "--data", other)
    # A text run has no template to render messages.
    text_run = make_run(tmp_path / "text-run")
    assert "no chat template" in refused(text_run, "--data", runs["conversational"])

    other_tokenizer = make_run(tmp_path / "other-tokenizer")
    err = refused(runs["dpo"], "--data", runs["text"], "--reference", other_tokenizer)
    assert "another tokenizer" in err and str(other_tokenizer) in err
    assert "pairs" in refused(runs["dpo"], "--data", runs["text"], "--answers")
    assert "--per-token" in refused(runs["dpo"], "--per-token")
    plain = tmp_path / "plain.txt"
    plain.write_text("hello there\n" * 40)
    assert "--reference" in refused(runs["base"], "--data", plain, "--reference", runs["base"])

    moved = tmp_path / "moved"
    shutil.copytree(runs["dpo"], moved)
    config = (moved / "config.yaml").read_text()
    gone = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(config.replace(str(runs["base"].resolve()), gone))
    err = refused(moved, "--data", runs["text"])
    assert gone in err and "no longer exists" in err and "--reference" in err


@pytest.fixture(scope="module")
def trl_trainer(runs, tmp_path_factory):
    """TRL's `DPOTrainer`, the policy and reference being the runs' Hugging Face exports."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("TRANSFORMERS_OFFLINE", "1")
        import datasets
        import transformers
        import trl  # the test extra's: a missing one fails here, it does not skip

        root = tmp_path_factory.mktemp("trl")
        for name in ("dpo", "base"):
            main_args = ["export", "--checkpoint", str(runs[name]), "--out", str(root / name)]
            with pytest.raises(SystemExit) as exc:
                main(main_args)
            assert exc.value.code == 0
        load = transformers.AutoModelForCausalLM.from_pretrained
        args = trl.DPOConfig(
            output_dir=str(root / "out"),
            beta=BETA,
            per_device_eval_batch_size=len(CONVERSATIONAL),  # one batch: its means are the pairs'
            max_length=None,  # every row fits the exported context; nothing cut on either side
            bf16=False,
            use_cpu=True,
            report_to=[],
            disable_dropout=True,
        )
        return trl.DPOTrainer(
            model=load(root / "dpo"),
            ref_model=load(root / "base"),
            args=args,
            train_dataset=datasets.Dataset.from_list(TEXT),
            processing_class=transformers.AutoTokenizer.from_pretrained(root / "dpo"),
        )


def trl_evaluate(trainer, rows: list[dict]) -> dict[str, float]:
    import datasets

    return trainer.evaluate(eval_dataset=datasets.Dataset.from_list(rows))


def test_trl_dpo_trainer_gives_the_same_loss_and_rewards_on_the_exports(runs, trl_trainer, capsys):
    """TRL's `DPOTrainer.evaluate`, the policy and reference being the runs' Hugging Face
    exports, gives `llmcli eval`'s figures on the same rows, as text and as messages (TRL
    appends the end-of-text token to a text completion; the template ends a message)."""
    for rows, data in ((TEXT, runs["text"]), (CONVERSATIONAL, runs["conversational"])):
        theirs = trl_evaluate(trl_trainer, rows)
        capsys.readouterr()  # the trainer may print its figures: ours alone are read below
        code, out, err = run_eval(capsys, runs["dpo"], "--data", data, "--json")
        assert code == 0, err
        ours = json.loads(out)
        assert ours["pairs"] == len(rows) and ours["truncated"] == ours["skipped"] == 0
        assert 0 < ours["rewards/accuracies"] < 1
        assert ours["loss_type"] == ["sigmoid"] and ours["loss_weights"] is None
        for name in (*TRL_NAMES, "logits/chosen", "logits/rejected"):
            expected = theirs[f"eval_{name}"]
            assert ours[name] == pytest.approx(expected, abs=1e-4), (data, name, expected)


# Every DPO loss type alone (those that read it with a label smoothing), and lists of them with
# weights: RPO (sigmoid + sft) and MPO (TRL's paper index's weights).
LOSS_SETTINGS = [
    *(
        {"loss_type": name, "label_smoothing": 0.1 if name in SMOOTHED_LOSS_TYPES else 0.0}
        for name in DPO_LOSS_TYPES
    ),
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    {"loss_type": "sigmoid,bco_pair,sft", "loss_weights": "0.8,0.2,1.0"},
]


@pytest.mark.parametrize("settings", LOSS_SETTINGS, ids=lambda s: str(s["loss_type"]))
def test_each_loss_type_is_trls_on_the_exports(runs, trl_trainer, settings, tmp_path, capsys):
    """`llmcli eval` on a DPO run with `train.loss_type` set gives the loss of TRL's
    `DPOTrainer.evaluate` with the same `loss_type`, `loss_weights` and `label_smoothing`."""
    run_dir = shutil.copytree(runs["dpo"], tmp_path / "run")
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["train"].update(settings)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    code, out, err = run_eval(capsys, run_dir, "--data", runs["conversational"], "--json")
    assert code == 0, err
    ours = json.loads(out)

    train = load_run(run_dir).config.train
    args = trl_trainer.args
    # What DPOTrainer.__init__ reads of its DPOConfig, set on the one trainer built (building
    # one per setting costs seconds each): DPOConfig turns a name into a one-name list.
    args.loss_type, args.loss_weights = train.loss_types, train.loss_weight_values
    args.label_smoothing = train.label_smoothing
    trl_trainer.loss_types = args.loss_type
    trl_trainer.loss_weights = args.loss_weights or [1.0] * len(args.loss_type)
    trl_trainer.label_smoothing = args.label_smoothing
    theirs = trl_evaluate(trl_trainer, CONVERSATIONAL)
    assert ours["loss_type"] == train.loss_types
    assert ours["loss"] == pytest.approx(theirs["eval_loss"], abs=1e-4)
    for name in ("rewards/margins", "logits/chosen", "logits/rejected"):
        assert ours[name] == pytest.approx(theirs[f"eval_{name}"], abs=1e-4), name


def test_the_text_names_a_loss_that_is_not_the_default(runs, tmp_path, capsys):
    run_dir = shutil.copytree(runs["dpo"], tmp_path / "run")
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["train"].update({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    code, out, err = run_eval(capsys, run_dir, "--data", runs["conversational"])
    assert code == 0, err
    assert f"(beta {BETA:g}, loss sigmoid + 0.5 sft): DPO loss " in out
