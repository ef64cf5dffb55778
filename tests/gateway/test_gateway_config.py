"""gateway.toml checks: a file that cannot be used is refused with its path and the key
named, by `load_config` and by the `infire gateway` command (exit 2, nothing served)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from infire.gateway.config import ConfigError, load_config

ADMIN = hashlib.sha256(b"admin").hexdigest()
BASE = """
[gateways.main]
[providers.up]
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
"""


def _load(tmp_path: Path, text: str):
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return load_config(path)


def test_a_good_file_loads(tmp_path: Path):
    config = _load(tmp_path, BASE + f"""
[gateways.locked]
authentication = true
max_attempts = 3
backoff = "linear"
limits = [{{ kind = "tokens", limit = 100, window_s = 60, technique = "sliding" }}]
[server]
admin_sha256 = "{ADMIN.upper()}"
max_body_bytes = 1000
[prices."up/m"]
input = 1.5
output = 2
""")  # fmt: skip
    assert config.admin_sha256 == ADMIN  # hex compared lower-case
    assert config.max_body_bytes == 1000 and config.store == tmp_path / "gateway.db"
    locked = config.gateways["locked"]
    assert locked.authentication and locked.retry.max_attempts == 3
    assert locked.retry.delay_s(2) == 0 and locked.limits[0].kind == "tokens"
    assert config.prices["up/m"].output == 2.0
    assert config.providers["up"].base_url == "http://127.0.0.1:9/v1"


@pytest.mark.parametrize(
    ("extra", "key", "problem"),
    [
        ("[gateways.locked]\nauthentication = true\n", "gateways.locked.authentication",
         "needs [server] admin_sha256"),
        ('[server]\nadmin_sha256 = "abc"\n', "server.admin_sha256", "SHA-256 in hex"),
        ("[server]\nadmin_token = 1\n", "server", "unknown keys ['admin_token']"),
        ('[tokens.t]\nsha256 = "zz"\n', "tokens.t.sha256", "SHA-256 in hex"),
        (f'[tokens.t]\nsha256 = "{ADMIN}"\ngateways = ["nope"]\n', "tokens.t.gateways",
         "configured gateways"),
        ('[gateways.g]\nbackoff = "random"\n', "gateways.g.backoff", "not one of"),
        ("[gateways.g]\nmax_attempts = 6\n", "gateways.g.max_attempts", "out of range"),
        ("[gateways.dashboard]\n", "gateways.dashboard", "reserved"),
        ('[providers.compat]\nkind = "openai"\nbase_url = "http://x"\n', "providers.compat",
         "reserved"),
        ('[providers.p]\nkind = "grpc"\nbase_url = "http://x"\n', "providers.p.kind",
         "not one of"),
        ('[providers.p]\nkind = "openai"\nbase_url = "ftp://x"\n', "providers.p.base_url",
         "http:// or https://"),
        ('[gateways.g]\nlimits = [{ kind = "bytes", limit = 1, window_s = 1 }]\n',
         "gateways.g.limits[0].kind", "not one of"),
        ('[store]\nredis_url = "http://x"\n', "store.redis_url", "redis://"),
        ("[prices.flat]\ninput = 1\n", "prices.flat", "provider/model"),
        ("[caching]\n", "caching", "unknown section"),
    ],
)  # fmt: skip
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, extra: str, key: str, problem: str):
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, BASE + extra)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'gateway.toml'}: {key}: "), message
    assert problem in message


def _serve(path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "infire.cli", "gateway", "--config", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_command_refuses_a_bad_file(tmp_path: Path):
    path = tmp_path / "gateway.toml"
    path.write_text(BASE + "[gateways.locked]\nauthentication = true\n")
    run = _serve(path)
    assert run.returncode == 2
    assert f"infire: error: {path}: gateways.locked.authentication:" in run.stderr
    run = _serve(tmp_path / "missing.toml")
    assert run.returncode == 2 and f"{tmp_path / 'missing.toml'}: cannot read" in run.stderr
    path.write_text("[gateways\n")
    run = _serve(path)
    assert run.returncode == 2 and f"{path}: not valid TOML" in run.stderr
