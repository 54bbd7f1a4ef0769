"""The compiled decode step (llmcli/generation/compiled_decode.py) against the plain loop: the
tokens of a padded batch, greedy and sampled, each prompt as it gets alone; the compile cache
(one compile per model and rows, reused by a later process, a new key for new weights); and
the errors a user gets. One compile (about 20 s): Inductor's kernels are not autotuned here
(`INDUCTOR_OPTIONS` without `max_autotune`), which changes which kernel computes a product, not
what the step computes."""

from __future__ import annotations

import sys

import pytest
import torch
from model_helpers import randomize_, tiny_model

from llmcli.config import SampleConfig
from llmcli.errors import InputError
from llmcli.generation import compiled_decode
from llmcli.generation.compiled_decode import CompiledDecoder, decode_key
from llmcli.generation.engine import generate_ids
from llmcli.generation.loop import generate as plain_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]  # left-padded into one batch


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A rotary, QK-norm model and its step compiled for 3 rows, in a cache of its own."""
    cache = tmp_path_factory.mktemp("compile-cache")
    model = randomize_(tiny_model(n_layer=1, pos_emb="rope", qk_norm=True)).eval()
    with pytest.MonkeyPatch.context() as patch:  # the options are part of the cache's key
        patch.setattr(compiled_decode, "INDUCTOR_OPTIONS", {"freezing": True})
        notes: list[str] = []
        limit = sys.getrecursionlimit()
        decoder = CompiledDecoder.for_model(model, 3, cache_dir=cache, notify=notes.append)
    assert len(notes) == 1 and "compiling the decode step for 3 row(s)" in notes[0]
    assert sys.getrecursionlimit() == limit  # as it was before Inductor raised it
    return model, decoder, cache


def alone(model, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
    """The plain loop's new tokens for one prompt (whole window recomputed every step), drawn
    as `generate` draws row `b`: from a generator seeded `seed + b`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        out = plain_generate(model, torch.tensor([prompt]), n, generator, temperature)
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow  # compiles (`compiled`)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_padded_batch_gets_the_plain_loops_tokens(compiled, temperature) -> None:
    """Padding masks and per-row positions go through the compiled step as the forward takes
    them: every prompt of the batch gets the tokens it gets alone in the plain loop, inside the
    context (10 tokens after a prompt of at most 5, in 16)."""
    model, decoder, _ = compiled
    config = SampleConfig(max_new_tokens=10, temperature=temperature, seed=4)
    got = generate_ids(model, PROMPTS, config, decode=decoder)
    for b, prompt in enumerate(PROMPTS):
        assert got[b] == alone(model, prompt, 10, temperature, 4 + b), f"prompt {b}"


@pytest.mark.slow  # compiles (`compiled`)
def test_steps_past_the_context_and_other_batch_sizes_still_match(compiled) -> None:
    """Past the context the `shift` policy re-prefills and decodes again with the compiled step;
    a batch of another size takes the fast step: the tokens are those of the plain forward."""
    model, decoder, _ = compiled
    config = SampleConfig(max_new_tokens=30, temperature=0.8, seed=2)
    assert generate_ids(model, PROMPTS, config, decode=decoder) == generate_ids(
        model, PROMPTS, config, decode=None
    )
    assert generate_ids(model, PROMPTS[:1], config, decode=decoder) == generate_ids(
        model, PROMPTS[:1], config, decode=None
    )


@pytest.mark.slow  # compiles (`compiled`)
def test_the_compiled_step_is_kept_and_reused(compiled, monkeypatch) -> None:
    """The same model and rows: the decoder made before; a new process (here: the last decoder
    cleared) loads the cached step without compiling; other weights make another key."""
    model, decoder, cache = compiled
    monkeypatch.setattr(compiled_decode, "INDUCTOR_OPTIONS", {"freezing": True})  # as compiled
    assert CompiledDecoder.for_model(model, 3, cache_dir=cache) is decoder
    CompiledDecoder.last = None
    notes: list[str] = []
    again = CompiledDecoder.for_model(model, 3, cache_dir=cache, notify=notes.append)
    assert notes == [] and again is not decoder
    config = SampleConfig(max_new_tokens=6, temperature=0.0)
    assert generate_ids(model, PROMPTS, config, decode=again) == generate_ids(
        model, PROMPTS, config, decode=decoder
    )
    other = randomize_(tiny_model(n_layer=1, pos_emb="rope", qk_norm=True), seed=1)
    assert decode_key(other, 3, 16) != decode_key(model, 3, 16)
    assert decode_key(model, 2, 16) != decode_key(model, 3, 16)


def test_a_compile_that_fails_names_the_fix(tmp_path, monkeypatch) -> None:
    model = tiny_model(n_layer=1)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: command not found\nmore detail")

    monkeypatch.setattr(compiled_decode, "compile_step", no_compiler)
    with pytest.raises(InputError, match=r"RuntimeError: g\+\+: command not found\).*--compile"):
        CompiledDecoder.for_model(model, 1, cache_dir=tmp_path, notify=lambda _: None)
    assert not any(tmp_path.rglob("*.pt2"))
    damaged = tmp_path / "decode" / f"{decode_key(model, 1, model.context_length)}.pt2"
    damaged.parent.mkdir(exist_ok=True)
    damaged.write_bytes(b"not a package")
    with pytest.raises(InputError, match="could not load the compiled decode step .*delete it"):
        CompiledDecoder.for_model(model, 1, cache_dir=tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(InputError, match="cannot write the compiled decode step in .*LLMCLI_CACHE"):
        CompiledDecoder.for_model(model, 1, cache_dir=a_file, notify=lambda _: None)
    with pytest.raises(InputError, match="model on the CPU only"):
        CompiledDecoder.for_model(torch.nn.Linear(2, 2), 1, cache_dir=tmp_path)


def test_compile_is_used_only_where_it_measured_faster(tmp_path, monkeypatch) -> None:
    """`sample --compile` takes the compiled step for a small model and few rows only
    (benchmarks/compiled_step.py); elsewhere it says so and keeps the default step, compiling
    nothing."""
    small = tiny_model(n_layer=1)
    big = tiny_model(n_layer=2, n_embed=256)
    assert sum(p.numel() for p in big.parameters()) > compiled_decode.PAYS_PARAMETERS
    rows = compiled_decode.PAYS_ROWS
    assert compiled_decode.pays(small, rows) and compiled_decode.pays(small, 1)
    assert not compiled_decode.pays(small, rows + 1) and not compiled_decode.pays(big, 1)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled where it does not pay")

    monkeypatch.setattr(compiled_decode, "compile_step", no_compile)
    for model, n in ((small, rows + 1), (big, 1)):
        notes: list[str] = []
        assert compiled_decode.decode_step(model, n, cache_dir=tmp_path, notify=notes.append) == (
            "auto"
        )
        assert len(notes) == 1 and "no faster than the default" in notes[0]
    asked: list[int] = []
    monkeypatch.setattr(
        CompiledDecoder, "for_model", classmethod(lambda cls, m, r, **kw: asked.append(r) or "c")
    )
    assert compiled_decode.decode_step(small, rows, cache_dir=tmp_path) == "c" and asked == [rows]
    with pytest.raises(InputError, match="model on the CPU only"):
        compiled_decode.decode_step(torch.nn.Linear(2, 2), 1)
