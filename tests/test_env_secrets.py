"""corral.env_secrets: the one reader of secrets from named environment variables."""

from __future__ import annotations

import pytest

from corral.env_secrets import SecretMissing, env_secret


def test_a_named_secret_is_read_and_a_missing_or_empty_one_is_refused_by_name() -> None:
    env = {"TOKEN": "s3cret", "EMPTY": ""}
    assert env_secret("TOKEN", "the env token", env) == "s3cret"
    assert env_secret(None, "the env token", env) is None  # none named: nothing to read
    for var in ("EMPTY", "ABSENT"):
        with pytest.raises(SecretMissing, match=f"the env token: environment variable {var} is"):
            env_secret(var, "the env token", env)


def test_the_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_TEST_SECRET", "abc")
    assert env_secret("CORRAL_TEST_SECRET", "x") == "abc"
    monkeypatch.delenv("CORRAL_TEST_SECRET")
    with pytest.raises(SecretMissing):
        env_secret("CORRAL_TEST_SECRET", "x")
