"""The chat template: the text it renders, the spans a model writes, and templates that fail.

The reference is `transformers` 5: its `render_jinja_template` for the text, and
`AutoTokenizer.apply_chat_template` on an exported run for the ids, with published templates
(tests/data/chat_templates/) and the clock frozen in both.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from chat_helpers import CONVERSATIONS, chat_tokenizer
from conftest import save_tiny_run
from hf_helpers import cli

from llmcli.data import chat_template as chat_template_module
from llmcli.data.chat_template import (
    TEMPLATE_FILE,
    ChatTemplate,
    default_template,
    load_run_template,
    require_run_template,
    template_from_file,
)
from llmcli.data.conversations import ConversationEncoder, add_chat_tokens
from llmcli.data.tokenizer import EOT, BPETokenizer, load_tokenizer
from llmcli.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_built_in_template_renders_each_turn_between_its_role_token_and_the_end_token():
    rendered = default_template().render(CONVERSATIONS[0], add_generation_prompt=False)
    expected = "<|system|>\nBe brief.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi!<|end|>\n"
    assert rendered.text == expected
    # The span a model writes: the assistant's text and its end-of-turn token, nothing else.
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["Hi!<|end|>"]


def test_the_generation_prompt_ends_where_the_reply_begins_and_marks_nothing():
    rendered = default_template().render(CONVERSATIONS[1][:3], add_generation_prompt=True)
    assert rendered.text == (
        "<|user|>\nSpell cat.<|end|>\n<|assistant|>\nc-a-t<|end|>\n<|user|>\nAnd dog?<|end|>\n"
        "<|assistant|>\n"
    )
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["c-a-t<|end|>"]


def test_the_template_renders_as_transformers_renders_it():
    """The same Jinja settings as `transformers` (trim_blocks, lstrip_blocks): a template
    written for the Hub renders here as it does there, spans included."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = default_template()
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            ours = template.render(messages, add_generation_prompt=prompt)
            rendered, spans = render_jinja_template(
                conversations=[messages],
                chat_template=template.source,
                add_generation_prompt=prompt,
                return_assistant_tokens_mask=True,
            )
            assert ours.text == rendered[0]
            assert list(ours.spans) == [tuple(s) for s in spans[0]]


def test_a_template_that_is_not_jinja_is_refused_naming_its_file(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}", encoding="utf-8")
    with pytest.raises(InputError, match=r"broken\.jinja.*not a valid Jinja template"):
        template_from_file(path)


def test_a_template_that_raises_on_the_messages_says_so():
    template = ChatTemplate("{{ raise_exception('only one turn, please') }}", origin="mine")
    with pytest.raises(InputError, match="mine does not render.*only one turn, please"):
        template.render(CONVERSATIONS[0], add_generation_prompt=False)


def test_a_template_that_renders_nothing_is_refused():
    with pytest.raises(InputError, match="empty text"):
        ChatTemplate("{# nothing #}").render(CONVERSATIONS[0], add_generation_prompt=False)


def test_a_missing_template_file_is_named(tmp_path):
    with pytest.raises(InputError, match=r"cannot read .*absent\.jinja"):
        template_from_file(tmp_path / "absent.jinja")


def test_a_run_keeps_its_template_and_a_run_without_one_says_how_to_make_one(tmp_path):
    assert load_run_template(tmp_path) is None
    with pytest.raises(InputError, match=r"no chat template.*data\.format: chat"):
        require_run_template(tmp_path)
    default_template().save(tmp_path)
    assert (tmp_path / TEMPLATE_FILE).read_text(encoding="utf-8") == default_template().source
    assert require_run_template(tmp_path) == default_template()


# --- As transformers renders it: the environment, the variables, published templates ----------

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"  # provenance in its README.md
SPECIAL = {"bos_token": EOT, "eos_token": EOT}  # what a run with an end-of-text token passes
FROZEN = datetime(2025, 2, 1, 9, 30)

# Text a template must write as it is: markup and entities that Jinja's own tojson escapes,
# quotes, non-ASCII, and tool-call arguments as an object whose keys are not in sorted order.
CHAT = [
    {"role": "system", "content": "Answer in <b>bold</b> & keep it 'short'."},
    {"role": "user", "content": 'Ünïcödé? 日本語 & "quotes" <tag>'},
    {"role": "assistant", "content": "Sí: <ok> & 'fine' — ✓"},
    {"role": "user", "content": "And 🙂?"},
    {"role": "assistant", "content": '🙂 > 😐 & "done"'},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <now> & 'later' in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["°C", "°F"]},
                },
                "required": ["city"],
            },
        },
    }
]
ARGUMENTS = {"city": "Zürich", "unit": "°C", "note": "<b>&'\""}
TOOL_CHAT = [
    {"role": "system", "content": "You use tools."},
    {"role": "user", "content": "Weather in Zürich & Genève?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    },
    {"role": "tool", "content": '{"temp": 22, "sky": "sunny <3"}'},
    {"role": "assistant", "content": 'It is 22°C & "sunny" <3'},
]


class FrozenDatetime(datetime):
    """`datetime` whose `now()` is `FROZEN`."""

    @classmethod
    def now(cls, tz=None):
        return FROZEN


@pytest.fixture
def frozen_clock(monkeypatch):
    """Both `strftime_now`s read `datetime.now()` through their module's `datetime`."""
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_module, "datetime", FrozenDatetime)
    monkeypatch.setattr(chat_template_utils, "datetime", FrozenDatetime)


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A `transformers` tokenizer whose special tokens are `SPECIAL`, for its
    `apply_chat_template(..., tokenize=False)`: the text of any template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=chat_tokenizer().hf, bos_token=EOT, eos_token=EOT
    )


def transformers_text(hf_tokenizer, source: str, messages, prompt=False, **kwargs) -> str:
    """`apply_chat_template`'s text, or the name of the error it raises."""
    try:
        return hf_tokenizer.apply_chat_template(
            messages, chat_template=source, add_generation_prompt=prompt, tokenize=False, **kwargs
        )
    except Exception as exc:  # compared with ours: both fail
        return type(exc).__name__


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages | tojson }}",
        "{{ messages[1] | tojson(indent=2) }}",
        "{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=true, ensure_ascii=true, "
        "separators=(',', ':')) }}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
        "{% endif %}{% if m.role == 'user' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}",
        "{{ dict(a=1, b='<x>') | tojson }} {{ dict.fromkeys(['k', 'j']) | tojson }}",
        "{{ strftime_now('%d %b %Y %H:%M') }}",
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ documents | tojson }}|"
        "{{ add_generation_prompt }}|{{ date_string }}",
        "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
        "{{ raise_exception('no <way>') }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    ],
)
def test_filters_globals_and_variables_are_transformers(source, hf_tokenizer, frozen_clock):
    """`tojson` without HTML escapes or sorted keys, `strftime_now`, `dict`, `namespace`,
    loop controls, and the variables and messages a template sees, as `transformers` gives
    them (a key whose value is None left out, reasoning under the names templates read)."""
    messages = [
        *CHAT[:3],
        {"role": "assistant", "content": "ok", "name": None, "reasoning": "<think> & 'so'"},
    ]
    context = {
        "tools": TOOLS,
        "documents": [{"title": "Ä & <b>", "text": "x"}],
        "date_string": "1 Jan 2030",
    }
    for prompt in (False, True):
        theirs = transformers_text(hf_tokenizer, source, messages, prompt, **context)
        try:
            ours = ChatTemplate(source).render(messages, prompt, **context, **SPECIAL).text
        except InputError as exc:
            assert theirs in str(exc)  # both fail, for the same reason
            continue
        assert ours == theirs
    if source == "{{ messages | tojson }}":  # Jinja's own filter writes \u003c for "<"
        assert "<b>bold</b> & keep it 'short'" in ours


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.jinja")))
def test_published_templates_render_their_text(name, hf_tokenizer, frozen_clock):
    """Each published template, with and without tools and extra variables, gives
    `transformers`' text: Llama's dates (its default, `strftime_now`'s, `date_string`) and
    tools in the system message, Qwen's tool calls, Zephyr's failure on a turn with no content."""
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    template = ChatTemplate(source, origin=name)
    cases = [
        (CHAT, {}),
        (TOOL_CHAT, {"tools": TOOLS}),
        (TOOL_CHAT, {"tools": TOOLS, "tools_in_user_message": False, "date_string": "1 Jan 2030"}),
    ]
    for messages, context in cases:
        for prompt, turns in ((False, messages), (True, messages[:-1])):
            theirs = transformers_text(hf_tokenizer, source, turns, prompt, **context)
            try:
                ours = template.render(turns, prompt, **context, **SPECIAL).text
            except InputError as exc:
                assert theirs == "UndefinedError" and "UndefinedError" in str(exc)
                continue
            assert ours == theirs
    dated = template.render(CHAT, **SPECIAL).text
    if "llama-3.2" in name:
        assert "Today Date: 01 Feb 2025\n" in dated  # strftime_now("%d %b %Y"), frozen
    if "llama-3.1" in name:
        assert "Today Date: 26 Jul 2024\n" in dated  # its own default date


# --- The ids of an exported run -----------------------------------------------------------------

# The published templates' own special tokens, added to the parity run's tokenizer so that each
# is one id (as in the models' tokenizers) in llmcli's encoding and transformers' alike.
TEMPLATE_TOKENS = (
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|im_start|>",
    "<|im_end|>",
)


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory) -> Path:
    """A chat run with a byte-level BPE tokenizer (any text encodes) that holds the chat
    tokens and the published templates' special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    text = " ".join(json.dumps(m, ensure_ascii=False) for m in (*CHAT, *TOOL_CHAT, *TOOLS))
    base = add_chat_tokens(BPETokenizer.train([text * 3], 400))
    grown = HFTokenizer.from_str(base.hf.to_str())
    grown.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in TEMPLATE_TOKENS]
    )
    raw = {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 1024},
        "data": {"tokenizer": "bpe", "format": "chat"},
    }
    return save_tiny_run(tmp_path_factory.mktemp("parity") / "run", BPETokenizer(grown), raw)


def mask_runs(ids: list[int], mask: list[bool], tokenizer) -> list[str]:
    """The text of each run of marked tokens."""
    runs: list[list[int]] = []
    for i, (token, marked) in enumerate(zip(ids, mask, strict=True)):
        if marked:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return [tokenizer.decode(run) for run in runs]


@pytest.mark.parametrize("name", [*sorted(p.name for p in TEMPLATES.glob("*.jinja")), "built-in"])
def test_an_exported_runs_apply_chat_template_gives_llmclis_ids(
    name, parity_run, tmp_path, frozen_clock, monkeypatch
):
    """The run holding a published template, exported: `AutoTokenizer`'s
    `apply_chat_template(..., tokenize=True)` gives the ids llmcli encodes (special tokens
    from the export's tokenizer_config.json, dates from the frozen clock, tools as schemas), and
    llmcli's mask marks each assistant turn's text to its end of turn (the prefix rule) or, for
    the built-in template, what transformers' assistant mask marks."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = tmp_path / "run"
    shutil.copytree(parity_run, run_dir)
    template = (
        default_template()
        if name == "built-in"
        else template_from_file(TEMPLATES / name, what=name)
    )
    template.save(run_dir)
    assert cli("export", "--checkpoint", run_dir, "--out", tmp_path / "hf") == 0
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    encoder = ConversationEncoder(require_run_template(run_dir), tokenizer)
    assert hf_tok.special_tokens_map == encoder.special_tokens == SPECIAL

    tool_use = name.startswith(("llama", "qwen"))
    for messages, tools in [(CHAT, None), *([(TOOL_CHAT, TOOLS)] if tool_use else [])]:
        ours = encoder.encode(messages, tools=tools)
        theirs = hf_tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
        assert ours.ids.tolist() == list(theirs["input_ids"])
        text = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False)
        assert encoder.render(messages, False, tools=tools).text == text
        assert "\\u003c" not in text and "<b>" in text  # transformers' tojson, not Jinja's
        prompt = hf_tok.apply_chat_template(
            messages[:-1], tools=tools, add_generation_prompt=True, return_dict=True
        )
        assert encoder.prompt(messages[:-1], tools=tools) == list(prompt["input_ids"])

        written = mask_runs(ours.ids.tolist(), ours.mask.tolist(), tokenizer)
        if name == "built-in":
            masked = hf_tok.apply_chat_template(
                messages, return_dict=True, return_assistant_tokens_mask=True
            )["assistant_masks"]
            assert ours.mask.astype(int).tolist() == list(masked)
        else:
            spans = template.render_training(messages, tools=tools, **SPECIAL).spans
            assert written == [text[a:b] for a, b in spans]
        # Every assistant turn's text is among what the model writes, the rest is not.
        replies = [m.get("content") for m in messages if m["role"] == "assistant"]
        for reply in filter(None, replies):
            assert sum(reply.strip() in w for w in written) == 1
        assert not any(m["content"] in w for m in messages if m["role"] == "user" for w in written)


# --- What a model writes, without {% generation %} -----------------------------------------


def test_the_prefix_rule_marks_each_assistant_turn_after_its_generation_prompt():
    """Qwen2.5's template has no {% generation %}: each assistant turn writes what it adds to
    the conversation before it with the generation prompt, the tool call or the text, its
    `<|im_end|>` and the newline after it, and nothing of the system, user or tool turns."""
    template = template_from_file(TEMPLATES / "qwen2.5-instruct.jinja")
    assert not template.marks_generation and default_template().marks_generation
    rendered = template.render_training(TOOL_CHAT, tools=TOOLS, **SPECIAL)
    assert [rendered.text[a:b] for a, b in rendered.spans] == [
        '<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Zürich", "unit": "°C", "note": "<b>&\'\\""}}\n</tool_call><|im_end|>\n',
        'It is 22°C & "sunny" <3<|im_end|>\n',
    ]
    prompt = template.render(TOOL_CHAT[:2], True, tools=TOOLS, **SPECIAL).text
    assert rendered.spans[0][0] == len(prompt)  # the first turn starts where the prompt ends
    # Zephyr's turns end with its eos_token (the run's end of text) and a newline.
    zephyr = template_from_file(TEMPLATES / "zephyr-7b-beta.jinja")
    rendered = zephyr.render_training(CONVERSATIONS[1], **SPECIAL)
    assert [rendered.text[a:b] for a, b in rendered.spans] == [
        f"c-a-t{EOT}\n",
        f"d-o-g{EOT}\n",
    ]


def test_the_prefix_rule_marks_tokens_of_the_encoded_conversation():
    """The mask over a char tokenizer's ids, by hand: a template without {% generation %}."""
    source = "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '.' }}{% endfor %}"
    source += "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}"
    encoder = ConversationEncoder(ChatTemplate(source), chat_tokenizer())
    encoded = encoder.encode(CONVERSATIONS[1])
    text = "u:Spell cat..a:c-a-t.u:And dog?.a:d-o-g."
    assert chat_tokenizer().decode(encoded.ids.tolist()) == text
    # "a:" is the generation prompt, so each reply is its text and its ".".
    expected = [False] * len("u:Spell cat..a:") + [True] * len("c-a-t.")
    expected += [False] * len("u:And dog?.a:") + [True] * len("d-o-g.")
    assert encoded.mask.tolist() == expected


def test_a_template_that_rerenders_earlier_turns_is_refused_naming_the_fix():
    """The last turn written differently from the same turn followed by others: no prefix
    tells what the assistant wrote, and the error asks for {% generation %}."""
    source = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
        "{% if loop.last %}{{ ' (last)' }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    template = ChatTemplate(source, origin="mine.jinja")
    with pytest.raises(
        InputError, match=r"mine\.jinja has no \{% generation %\}.*message 1 \(the assistant's\)"
    ):
        template.render_training(CONVERSATIONS[1])
    with pytest.raises(InputError, match=r"Put \{% generation %\}\.\.\.\{% endgeneration %\}"):
        template.render_training(CONVERSATIONS[1])


def test_bad_templates_and_messages_exit_2_with_the_reason(tmp_path, capsys):
    """`llmcli eval` on a run whose template raises, or re-renders earlier turns: exit status
    2 and the reason, no traceback. A published template's own raise_exception is one too."""
    from chat_helpers import save_chat_run

    llama = template_from_file(TEMPLATES / "llama-3.1-instruct.jinja")
    two_calls = {**TOOL_CHAT[2], "tool_calls": TOOL_CHAT[2]["tool_calls"] * 2}
    with pytest.raises(InputError, match="only supports single tool-calls"):
        llama.render([*TOOL_CHAT[:2], two_calls], **SPECIAL)

    run_dir = save_chat_run(tmp_path / "run")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    templates = {
        "{{ raise_exception('no dogs here') }}": "does not render these messages.*no dogs here",
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}": (
            r"no \{% generation %\} tags"
        ),
    }
    for source, message in templates.items():
        (run_dir / TEMPLATE_FILE).write_text(source, encoding="utf-8")
        capsys.readouterr()
        assert cli("eval", "--checkpoint", run_dir, "--data", data, "--no-progress") == 2
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err
