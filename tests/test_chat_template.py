"""The chat template: the text it renders, the spans a model writes, and templates that fail."""

from __future__ import annotations

import pytest
from chat_helpers import CONVERSATIONS

from llmcli.data.chat_template import (
    TEMPLATE_FILE,
    ChatTemplate,
    default_template,
    load_run_template,
    require_run_template,
    template_from_file,
)
from llmcli.errors import InputError


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
