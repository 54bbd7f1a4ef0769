"""The run directory: atomic writes, safe loading, validation, latest run
(llmcli/runs/formats.py, directory.py, loading.py)."""

from __future__ import annotations

import errno
import os
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save

from llmcli import fileio
from llmcli.config import Config, ModelConfig
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import CheckpointError, describe_os_error
from llmcli.model.gpt import Transformer
from llmcli.runs import formats, loading
from llmcli.runs.directory import STATE_FILE, ensure_run_dir, save_model_run
from llmcli.runs.formats import WEIGHTS_FORMAT, load_state, read_weights, save_state
from llmcli.runs.loading import find_latest_run, latest_run_notice, load_run, run_kind

TEXT = "To be, or not to be, that is the question.\n"


def make_run(run_dir: Path, *, tie: bool = True, step: int = 7) -> tuple[Config, Transformer]:
    config = Config(
        model=ModelConfig(n_layer=1, n_head=2, n_embed=16, context_length=8, tie_embeddings=tie)
    )
    tok = CharTokenizer.train([TEXT])
    model = Transformer(config.model, tok.vocab_size, generator=torch.Generator().manual_seed(3))
    save_model_run(run_dir, config, tok, model, extra_meta={"step": step})
    return config, model


class Marker:
    """A pickled object that would create a file when unpickled (if loading ran code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# --- atomic writes ---------------------------------------------------------------------------


def test_atomic_write_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    fileio.atomic_write_bytes(path, b"old")
    fileio.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_a_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "f.bin"
    fileio.atomic_write_bytes(path, b"previous content")

    def disk_full(tmp: Path, data: bytes) -> None:
        tmp.write_bytes(data[: len(data) // 2])  # half written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio, "_write_and_sync", disk_full)
    with pytest.raises(OSError) as info:
        fileio.atomic_write_bytes(path, b"new content that does not fit")
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"previous content"
    assert os.listdir(tmp_path) == ["f.bin"]
    assert "no space left" in describe_os_error(info.value)


def test_ensure_run_dir_refuses_a_path_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot write to output directory"):
        ensure_run_dir(tmp_path / "file" / "run")
    with pytest.raises(CheckpointError, match="not a directory"):
        ensure_run_dir(tmp_path / "file")


# --- saving and loading a run ----------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_round_trip(tmp_path: Path, tie: bool) -> None:
    config, model = make_run(tmp_path / "run", tie=tie)
    names = sorted(os.listdir(tmp_path / "run"))
    assert names == [
        "best.safetensors",
        "config.yaml",
        "meta.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    run = load_run(tmp_path / "run")
    assert run.weights_path == tmp_path / "run" / "best.safetensors"
    assert run.step == 7 and run.meta["step"] == 7 and run.meta["versions"]["torch"]
    assert run.config.to_dict() == config.to_dict()
    assert run.tokenizer.decode(run.tokenizer.encode(TEXT)) == TEXT
    assert not run.model.training
    assert (run.model.lm_head.weight is run.model.wte.weight) is tie
    for (name, a), (_, b) in zip(
        model.state_dict().items(), run.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    idx = torch.tensor([run.tokenizer.encode("To be")])
    model.eval()
    assert torch.equal(model(idx)[0], run.model(idx)[0])
    assert load_run(tmp_path / "run", weights="last").weights_path.name == "model.safetensors"


def test_find_latest_run_picks_the_newest_weights(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="llmcli train tiny"):
        find_latest_run(tmp_path)
    make_run(tmp_path / "a")
    make_run(tmp_path / "b")
    (tmp_path / "not-a-run").mkdir()
    now = time.time()
    os.utime(tmp_path / "a" / "model.safetensors", (now, now))
    os.utime(tmp_path / "b" / "model.safetensors", (now - 100, now - 100))
    assert find_latest_run(tmp_path) == tmp_path / "a"
    os.utime(tmp_path / "b" / "model.safetensors", (now + 100, now + 100))
    assert find_latest_run(tmp_path) == tmp_path / "b"
    make_run(tmp_path / "group" / "c")  # runs in sub-folders count too
    os.utime(tmp_path / "group" / "c" / "model.safetensors", (now + 200, now + 200))
    assert find_latest_run(tmp_path) == tmp_path / "group" / "c"


def test_the_latest_run_of_the_kind_a_command_wants_comes_first_and_the_notice_says_so(
    tmp_path: Path,
) -> None:
    make_run(tmp_path / "tiny")
    make_run(tmp_path / "chat")
    (tmp_path / "chat" / "chat_template.jinja").write_text("{{ messages }}")
    now = time.time()
    os.utime(tmp_path / "tiny" / "model.safetensors", (now - 100, now - 100))
    os.utime(tmp_path / "chat" / "model.safetensors", (now, now))  # the chat run is newer
    assert run_kind(tmp_path / "chat") == "chat" and run_kind(tmp_path / "tiny") == "text"
    assert find_latest_run(tmp_path) == tmp_path / "chat"
    assert find_latest_run(tmp_path, kind="chat") == tmp_path / "chat"
    assert find_latest_run(tmp_path, kind="text") == tmp_path / "tiny"
    chat, tiny = tmp_path / "chat", tmp_path / "tiny"
    assert latest_run_notice(tiny, tmp_path, kind="text") == (
        f"using the latest text run: {tiny}, at step 7 (the newer chat run is {chat}, at step 7: "
        f"--checkpoint {chat} picks it)"
    )
    assert latest_run_notice(chat, tmp_path) == f"using the latest chat run: {chat}, at step 7"
    # A command for chat runs is never pointed at a text run it would refuse.
    os.utime(tmp_path / "tiny" / "model.safetensors", (now + 100, now + 100))
    assert latest_run_notice(chat, tmp_path, kind="chat") == (
        f"using the latest chat run: {chat}, at step 7"
    )
    # With no run of the kind wanted, the latest of the other kind (the notice names its kind).
    assert find_latest_run(tmp_path / "chat", kind="text") == chat


def test_missing_run_and_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_run(tmp_path / "nope")
    make_run(tmp_path / "run")
    for name in ("tokenizer.json", "config.yaml"):
        (tmp_path / "run" / name).rename(tmp_path / name)
        with pytest.raises(CheckpointError, match=name):
            load_run(tmp_path / "run")
        (tmp_path / name).rename(tmp_path / "run" / name)
    for name in ("best.safetensors", "model.safetensors"):
        (tmp_path / "run" / name).unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_run(tmp_path / "run")


def test_a_pickle_as_weights_is_refused_unread(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    marker = tmp_path / "code-ran"
    torch.save({"w": Marker(str(marker))}, tmp_path / "run" / "best.safetensors")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_run(tmp_path / "run")
    assert not marker.exists()


def test_a_pickle_as_resume_state_is_refused_unread(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"format": WEIGHTS_FORMAT, "x": Marker(str(marker))}, tmp_path / "state.pt")
    with pytest.raises(CheckpointError, match="refused unread") as info:
        load_state(tmp_path / STATE_FILE)
    assert "state.pt" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("keep", [0, 5, 100, 0.5, 0.99])
def test_truncated_weights_are_reported_as_corrupt_naming_the_file(
    tmp_path: Path, keep: float
) -> None:
    make_run(tmp_path / "run")
    path = tmp_path / "run" / "best.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError, match="truncated|corrupt|not a safetensors") as info:
        load_run(tmp_path / "run")
    assert str(path) in str(info.value)


def test_weights_cut_by_one_byte_are_truncated_and_whole_ones_load(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    w = torch.arange(10.0)
    data = save({"w": w}, metadata={"format": WEIGHTS_FORMAT})
    path.write_bytes(data)
    tensors, metadata = read_weights(path)  # every byte the header promises: loads
    assert torch.equal(tensors["w"], w) and metadata == {"format": WEIGHTS_FORMAT}
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match=rf"truncated: {len(data) - 1} bytes, {len(data)} "):
        read_weights(path)
    path.write_bytes(data[:9])  # the length, and the first byte of the header it gives
    with pytest.raises(CheckpointError, match=r"truncated: its header says \d+ bytes .* 9 in all"):
        read_weights(path)
    path.write_bytes(data[:7])  # not even the length
    with pytest.raises(CheckpointError, match=r"truncated \(7 bytes\)"):
        read_weights(path)


def test_weights_are_mapped_not_read_into_a_second_copy(tmp_path: Path) -> None:
    # Reading the file into bytes and deserializing those held it twice; tracemalloc sees
    # Python's buffers (a bytes copy) but not torch's tensors, so the peak would be the file.
    path = tmp_path / "w.safetensors"
    w = torch.randn(2 * 1024 * 1024, generator=torch.Generator().manual_seed(0))  # 8 MiB
    path.write_bytes(save({"w": w}, metadata={"format": WEIGHTS_FORMAT}))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        tensors, _ = read_weights(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(tensors["w"], w)
    assert peak < size / 16, f"peak {peak} bytes of Python memory for a {size}-byte file"


def test_weights_replaced_while_read_come_from_the_file_opened(tmp_path, monkeypatch) -> None:
    # A run saved while it is read replaces the file by a rename: the mapping keeps the old
    # file, so the tensors and metadata read are one file's, never a mix.
    path, newer = tmp_path / "w.safetensors", tmp_path / "newer.safetensors"
    path.write_bytes(save({"w": torch.zeros(1000)}, metadata={"format": WEIGHTS_FORMAT, "s": "1"}))
    newer.write_bytes(save({"w": torch.ones(1000)}, metadata={"format": WEIGHTS_FORMAT, "s": "2"}))
    real = formats.safe_open

    def open_then_replace(*args, **kwargs):
        opened = real(*args, **kwargs)
        os.replace(newer, path)  # the atomic save of another process, after the open
        return opened

    monkeypatch.setattr(formats, "safe_open", open_then_replace)
    tensors, metadata = read_weights(path)
    assert torch.equal(tensors["w"], torch.zeros(1000)) and metadata["s"] == "1"
    monkeypatch.undo()
    tensors, metadata = read_weights(path)
    assert torch.equal(tensors["w"], torch.ones(1000)) and metadata["s"] == "2"


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.9])
def test_truncated_resume_state_is_reported_as_corrupt_naming_the_file(
    tmp_path: Path, fraction: float
) -> None:
    path = tmp_path / STATE_FILE
    save_state(path, {"format": WEIGHTS_FORMAT, "step": 3, "w": torch.arange(1000.0)})
    assert load_state(path)["step"] == 3
    data = path.read_bytes()
    path.write_bytes(data[: int(fraction * len(data))])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
        load_state(path)
    assert str(path) in str(info.value)


def test_tokenizer_and_weights_from_different_runs_are_refused(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    CharTokenizer.train(["abc"]).save(tmp_path / "run" / "tokenizer.json")
    with pytest.raises(CheckpointError, match="different runs"):
        load_run(tmp_path / "run")


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    path = tmp_path / "run" / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    for key, value, held in (("n_embed", 32, 16), ("n_layer", 2, 1), ("context_length", 16, 8)):
        edited = {**raw, "model": {**raw["model"], key: value}}
        path.write_text(yaml.safe_dump(edited))
        with pytest.raises(CheckpointError, match=rf"model\.{key} = {value} but .* hold {held}"):
            load_run(tmp_path / "run")


def test_a_config_edited_to_a_huge_model_fails_before_building_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10**6 layers would take minutes and gigabytes to build: the check reads only the header,
    # so the model is never built (counted, not timed).
    make_run(tmp_path / "run")
    path = tmp_path / "run" / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"]["n_layer"] = 10**6
    path.write_text(yaml.safe_dump(raw))
    built = []
    monkeypatch.setattr(loading, "Transformer", lambda *args, **kwargs: built.append(args))
    with pytest.raises(CheckpointError, match=r"model\.n_layer = 1000000 but .* hold 1"):
        load_run(tmp_path / "run")
    assert built == []


def test_rope_weights_without_a_position_table_still_check_layers(tmp_path: Path) -> None:
    config = Config(
        model=ModelConfig(n_layer=2, n_head=2, n_embed=16, context_length=8, pos_emb="rope")
    )
    tok = CharTokenizer.train([TEXT])
    model = Transformer(config.model, tok.vocab_size)
    save_model_run(tmp_path / "run", config, tok, model, extra_meta={"step": 1})
    assert load_run(tmp_path / "run").model.n_layer == 2
    path = tmp_path / "run" / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"]["n_layer"] = 3
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(CheckpointError, match=r"model\.n_layer = 3 but .* hold 2"):
        load_run(tmp_path / "run")


def test_a_broken_config_in_a_run_names_the_file(tmp_path: Path) -> None:
    make_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("model: {n_head: 3}\n")
    with pytest.raises(CheckpointError, match="config.yaml"):
        load_run(tmp_path / "run")


def test_a_failed_extra_file_write_is_the_saves_checkpoint_error(tmp_path: Path) -> None:
    # A LoRA run's adapter files go through the save: a failure names the save and the
    # previous checkpoint, and the resume state (the commit point) is not written.
    from llmcli.runs.directory import save_checkpoint

    model = Transformer(ModelConfig(n_layer=1, n_head=2, n_embed=8, context_length=4), 10)
    (tmp_path / "adapter_model.safetensors").mkdir()  # a folder where the file should go
    with pytest.raises(CheckpointError, match=r"step 3 .* previous checkpoint \(step 1\)"):
        save_checkpoint(
            tmp_path,
            model,
            {},
            {"step": 3, "vocab_size": 10},
            best=False,
            previous_step=1,
            extra_files={"adapter_model.safetensors": b"x"},
        )
    assert not (tmp_path / STATE_FILE).exists()
