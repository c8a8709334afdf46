"""The shared token's rules: strength estimate, who may read its file, where no token is allowed."""

import logging
import random
import string

import pytest

from ddiloco.net import auth
from ddiloco.net.auth import AuthConfigError


def _hex_tokens(n, chars, seed=0):
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789abcdef") for _ in range(chars)) for _ in range(n)]


def test_every_token_like_the_readmes_passes_and_one_byte_less_does_not():
    for token in _hex_tokens(2000, 32):  # secrets.token_hex(16): 32 hex characters, 128 bits
        auth.check_token(token)
        assert auth.estimated_bits(token) == 128
    for token in _hex_tokens(200, 30, seed=1):
        with pytest.raises(AuthConfigError, match="estimated 120 bits"):
            auth.check_token(token)


@pytest.mark.parametrize(
    "token, alphabet, length",
    [
        ("0123456789abcdef", 16, 16),
        ("0123456789ABCDEF", 16, 16),
        ("0123456789abcdeF", 62, 16),  # mixed case is not hex
        ("abc", 16, 3),  # hex letters only: the hex alphabet
        ("xyz", 26, 3),
        ("aB3", 62, 3),
        ("a-B3", 94, 4),
        ("ab\u00e9\u00e8", 28, 4),  # one per distinct character outside the usual classes
        ("xyzxyzxy", 26, 3),
        ("ghijklmng", 26, 9),  # a period of 8 is no repetition
        ("aaaa", 16, 1),
    ],
)
def test_alphabet_and_effective_length(token, alphabet, length):
    assert auth.alphabet_size(token) == alphabet
    assert auth.effective_length(token) == length


@pytest.mark.parametrize(
    "token, message",
    [
        ("a" * 16, "only 1 distinct characters"),
        ("a" * 200, "only 1 distinct characters"),
        ("ab" * 40, "only 2 distinct characters"),
        ("01" * 20 + "0011" * 10, "only 2 distinct characters"),
        ("Password-1234567", "estimated 105 bits"),
        (string.ascii_letters[:20] * 4, "estimated 94 bits"),  # 20 x log2(26)
        ("a1B2c3D4e5F6g7H8", "estimated 95 bits"),  # 16 x log2(62)
        ("short", "must be 16 to 4096 bytes"),
        ("with space 0123456789abcdef", "must not contain whitespace"),
    ],
)
def test_weak_tokens_are_refused_with_the_reason(token, message):
    with pytest.raises(AuthConfigError, match=message):
        auth.check_token(token)


@pytest.mark.parametrize(
    "mode, who", [(0o644, "group and others"), (0o640, "group"), (0o604, "others"), (0o666, "group and others")]
)
def test_a_token_file_others_may_read_is_refused_or_accepted_with_a_warning(tmp_path, caplog, mode, who):
    path = tmp_path / "token"
    path.write_text(_hex_tokens(1, 32)[0] + "\n")
    path.chmod(mode)
    with pytest.raises(AuthConfigError, match=f"readable by {who} \\(mode {mode:04o}\\): run `chmod 600"):
        auth.read_token_file(path)
    with caplog.at_level(logging.WARNING, logger="ddiloco.auth"):
        assert auth.read_token_file(path, allow_shared=True) == _hex_tokens(1, 32)[0]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "whoever can read it can join" in caplog.text


def test_write_token_file_makes_a_private_file_and_never_overwrites(tmp_path):
    token = _hex_tokens(1, 32)[0]
    path = auth.write_token_file(tmp_path / "token", token)
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_token_file(path) == token
    with pytest.raises(FileExistsError):
        auth.write_token_file(path, token)
    with pytest.raises(AuthConfigError):
        auth.write_token_file(tmp_path / "weak", "a" * 32)
    assert not (tmp_path / "weak").exists()


def test_a_token_file_that_cannot_be_read_or_holds_a_weak_token_says_which_file(tmp_path):
    with pytest.raises(AuthConfigError, match="cannot read the auth token file .*missing"):
        auth.read_token_file(tmp_path / "missing")
    weak = tmp_path / "weak"
    weak.write_text("a" * 20)
    weak.chmod(0o600)
    with pytest.raises(AuthConfigError, match=f"the auth token in {weak}: auth token has only 1 distinct"):
        auth.read_token_file(weak)


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.3", False),
        ("syncer.example", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert auth.is_loopback(host) is loopback


def test_no_token_is_refused_only_where_other_machines_can_connect():
    auth.check_exposure("127.0.0.1", None, insecure_no_auth=False)
    auth.check_exposure("0.0.0.0", "a-token", insecure_no_auth=False)
    auth.check_exposure("0.0.0.0", None, insecure_no_auth=True)
    with pytest.raises(AuthConfigError, match="no auth token on '0.0.0.0'.*--insecure-no-auth"):
        auth.check_exposure("0.0.0.0", None, insecure_no_auth=False)
