"""Ray's token file: readable by its owner only when the executor starts a local Ray."""
import os
import stat

import pytest

from pp_runtime.executors.local_ray import owner_only_token


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_token_is_written_0600_in_a_0700_directory(home):
    old = os.umask(0o022)  # the usual umask, under which Ray itself writes 0644
    try:
        path = owner_only_token()
    finally:
        os.umask(old)
    assert path == home / ".ray" / "auth_token"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 bits in hex, as Ray makes them
    assert owner_only_token() == path and path.read_text() == token  # never replaced


def test_an_existing_readable_token_is_tightened_and_kept(home):
    (home / ".ray").mkdir()
    path = home / ".ray" / "auth_token"
    path.write_text("abc")
    path.chmod(0o644)
    assert owner_only_token() == path
    assert mode(path) == 0o600 and path.read_text() == "abc"


@pytest.mark.parametrize("var, value", [("RAY_AUTH_MODE", "disabled"),
                                        ("RAY_AUTH_TOKEN", "t"),
                                        ("RAY_AUTH_TOKEN_PATH", "/elsewhere")])
def test_a_token_from_elsewhere_or_no_auth_is_left_alone(home, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    assert owner_only_token() is None
    assert not (home / ".ray").exists()
