"""Hugging Face Hub names (`llmcli.hub.resolve_pretrained`, `data.tokenizer: org/name`), offline.

Every test builds a Hub cache in a temporary folder in huggingface_hub's own layout
(`models--org--name/{blobs,snapshots/<commit>,refs/<revision>}`) and points `HF_HUB_CACHE` at
it. The network is never used: offline mode is on, or `HF_ENDPOINT` is a closed local port (the
connection fails at once), or a local HTTP server answers as the Hub does for a missing, gated
or unknown-revision repository.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from conftest import CLOSED_PORT, COMMIT, OTHER_COMMIT, cache_repo, go_online
from huggingface_hub import constants

from llmcli.cli import main
from llmcli.config import DataConfig
from llmcli.data.tokenizer import BPETokenizer, train_tokenizer
from llmcli.errors import InputError
from llmcli.hub import resolve_pretrained, split_hub_name

TEXT = "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def resolve(name: str) -> Path:
    return resolve_pretrained(name, what="test.model", patterns=TOKENIZER_FILES)


# --- names ---------------------------------------------------------------------------------


def test_hub_names_and_paths_are_told_apart() -> None:
    assert split_hub_name("gpt2") == ("gpt2", None)
    assert split_hub_name("openai-community/gpt2") == ("openai-community/gpt2", None)
    assert split_hub_name("org/name@v1.0") == ("org/name", "v1.0")
    assert split_hub_name(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for path in ("../x y", "./model", "/abs/model", "a/b/c", "org/name@", "x--y", "name.git"):
        assert split_hub_name(path) is None, path
    # llmcli's own folder is never a Hub organisation, made or not
    assert split_hub_name("checkpoints/chat") is None


def test_a_name_whose_first_folder_exists_here_is_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert split_hub_name("runs/chat") == ("runs/chat", None)
    (tmp_path / "runs").mkdir()
    assert split_hub_name("runs/chat") is None


@pytest.mark.parametrize(("config", "base"), [("grpo", "chat"), ("chat", "tiny")])
def test_a_missing_starting_run_says_to_train_it_not_that_the_network_is_down(
    hub_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    config: str,
    base: str,
) -> None:
    go_online(monkeypatch)  # a Hub request would fail at once, blaming the network
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["train", config])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: train.init_from ('checkpoints/{base}') does not exist: no folder" in err
    assert f"'{tmp_path / 'checkpoints' / base}'" in err
    assert f"It is the run that `llmcli train {base}` makes: train it first" in err
    assert "Hugging Face Hub" not in err and "network" not in err
    assert not (tmp_path / "checkpoints" / config).exists()


def test_existing_folder_and_file_are_used_as_they_are(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    file = tmp_path / "tok.json"
    file.write_text("{}", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert resolve("org/name") == Path("org/name")  # a folder wins over the Hub name it spells
    assert resolve(file) == file


def test_bad_name_is_neither_path_nor_hub_name(hub_cache: Path) -> None:
    with pytest.raises(InputError, match=r"test\.model '\.\./x y' is neither an existing file"):
        resolve("../x y")


# --- the cache, offline ----------------------------------------------------------------------


def test_cached_name_resolves_to_its_snapshot_offline(hub_cache: Path) -> None:
    files = {"tokenizer.json": "{}", "config.json": '{"a": 1}'}
    snapshot = cache_repo(hub_cache, "org/name", files)
    got = resolve("org/name")
    assert got == snapshot
    assert (got / "tokenizer.json").read_text(encoding="utf-8") == "{}"
    assert cache_repo(hub_cache, "gpt2", {"tokenizer.json": "{}"}) == resolve("gpt2")


def test_revisions_by_branch_or_commit(hub_cache: Path) -> None:
    main_snapshot = cache_repo(hub_cache, "org/name", {"tokenizer.json": "{}"})
    v1 = cache_repo(hub_cache, "org/name", {"tokenizer.json": "[]"}, OTHER_COMMIT, ref="v1")
    assert resolve("org/name") == main_snapshot
    assert resolve("org/name@v1") == v1
    assert resolve(f"org/name@{OTHER_COMMIT}") == v1
    assert resolve(f"org/name@{COMMIT}") == main_snapshot


def test_name_missing_from_the_cache_offline(hub_cache: Path) -> None:
    with pytest.raises(InputError) as err:
        resolve("org/missing")
    msg = str(err.value)
    assert "test.model 'org/missing' is a Hugging Face Hub name that is not in the cache" in msg
    assert f"not in the cache at {hub_cache}," in msg
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in msg
    assert "run once with the network" in msg and "hf download org/missing" in msg
    cache_repo(hub_cache, "org/name", {"tokenizer.json": "{}"})
    with pytest.raises(InputError, match=r"not in the cache.*hf download org/name --revision v2"):
        resolve("org/name@v2")


def test_offline_mode_is_read_from_the_environment_at_call_time(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as if imported while online
    with pytest.raises(InputError, match="offline mode is on"):
        resolve("org/missing")
    other = hub_cache.parent / "other"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))  # the cache too, not huggingface_hub's copy
    with pytest.raises(InputError, match=f"not in the cache at {other}"):
        resolve("org/missing")


# --- no network, or a Hub that says no -------------------------------------------------------


def test_unreachable_hub_fails_at_once_and_a_warm_cache_still_works(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go_online(monkeypatch)
    # "At once": no retries and no backoff, counted rather than timed: the connection attempts
    # (the Hub's, and at most one more, huggingface_hub asking the same port for its agent
    # registry once per process) and the waits between them, which pass no time here.
    attempts, waits = [], []
    connect, sleep, main_thread = socket.socket.connect, time.sleep, threading.current_thread()

    def counted_connect(sock: socket.socket, address: object) -> None:
        attempts.append(address)
        connect(sock, address)

    def counted_sleep(seconds: float) -> None:
        if threading.current_thread() is main_thread:
            waits.append(seconds)
        else:
            sleep(seconds)

    with pytest.MonkeyPatch.context() as counting:
        counting.setattr(socket.socket, "connect", counted_connect)
        counting.setattr(time, "sleep", counted_sleep)
        with pytest.raises(InputError) as err:
            resolve("org/missing")
    assert 1 <= len(attempts) <= 2 and set(attempts) == {("127.0.0.1", 9)}, attempts
    assert waits == []
    msg = str(err.value)
    assert f"not in the cache at {hub_cache}" in msg
    assert f"the Hub ({CLOSED_PORT}) could not be reached (no network?)" in msg
    snapshot = cache_repo(hub_cache, "org/name", {"tokenizer.json": "{}"})
    assert resolve("org/name") == snapshot


class _HubSaysNo(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers for the error code in the server's `code`."""

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        status = {"RepoNotFound": 404, "GatedRepo": 403, "RevisionNotFound": 404}
        self.send_response(status[self.server.code])  # type: ignore[attr-defined]
        self.send_header("X-Error-Code", self.server.code)  # type: ignore[attr-defined]
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_hub() -> Iterator[http.server.HTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubSaysNo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("RepoNotFound", r"there is no Hugging Face Hub repository 'org/name' \(or it is private"),
        ("GatedRepo", r"repository 'org/name' is gated: accept its terms"),
        ("RevisionNotFound", r"repository 'org/name' has no revision 'v9'"),
    ],
)
def test_hub_errors_say_which(
    hub_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    local_hub: http.server.HTTPServer,
    code: str,
    expected: str,
) -> None:
    go_online(monkeypatch, f"http://127.0.0.1:{local_hub.server_address[1]}")
    local_hub.code = code  # type: ignore[attr-defined]
    with pytest.raises(InputError, match=r"test\.model 'org/name(@v9)?': .*" + expected):
        resolve("org/name@v9" if code == "RevisionNotFound" else "org/name")


# --- data.tokenizer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([TEXT * 20], vocab_size=300)


def test_data_tokenizer_from_a_cached_hub_name(hub_cache: Path, bpe: BPETokenizer) -> None:
    cache_repo(hub_cache, "org/tok", {"tokenizer.json": bpe.to_json(), "config.json": "{}"})
    tok = train_tokenizer(DataConfig(tokenizer="org/tok"), "ignored")
    assert isinstance(tok, BPETokenizer) and tok.to_json() == bpe.to_json()
    assert tok.encode(TEXT) == bpe.encode(TEXT) and tok.eot_id == bpe.eot_id
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_data_tokenizer_from_a_folder(tmp_path: Path, bpe: BPETokenizer) -> None:
    folder = tmp_path / "my-tokenizer"
    folder.mkdir()
    with pytest.raises(InputError, match=r"the folder '.*my-tokenizer' has no tokenizer\.json"):
        train_tokenizer(DataConfig(tokenizer=str(folder)), "x")
    bpe.save(folder / "tokenizer.json")
    assert train_tokenizer(DataConfig(tokenizer=str(folder)), "x").to_json() == bpe.to_json()


def test_data_tokenizer_hub_repo_without_tokenizer_json(hub_cache: Path) -> None:
    cache_repo(hub_cache, "org/slow", {"vocab.txt": "a\nb\n"})
    with pytest.raises(
        InputError, match=r"the Hub repository \(fetched into .*\) has no tokenizer"
    ):
        train_tokenizer(DataConfig(tokenizer="org/slow"), "x")


def test_data_tokenizer_missing_hub_name_exits_2_through_the_cli(
    hub_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT * 20, encoding="utf-8")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"data: {{path: {str(corpus)!r}}}\nmodel: {{context_length: 16}}\n")
    argv = ["prepare-data", str(cfg), "--cache-dir", str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--set", "data.tokenizer=org/missing-tokenizer"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: data.tokenizer 'org/missing-tokenizer' is a Hugging Face Hub name" in err
    assert f"not in the cache at {hub_cache}" in err and "Traceback" not in err


def test_importing_llmcli_does_not_load_the_hub_download_machinery() -> None:
    """Resolving a Hub name loads `snapshot_download` (~0.4 s); other commands never do."""
    code = (
        "import sys, llmcli.data.tokenizer, llmcli.hub; "
        "print('huggingface_hub.hf_api' in sys.modules, "
        "'huggingface_hub._snapshot_download' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    assert callable(huggingface_hub.snapshot_download)
