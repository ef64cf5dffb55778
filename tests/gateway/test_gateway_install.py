"""The gateway alone (issue 19): the infire-gateway wheel, built from this checkout by
gateway-dist/build_wheel.py, installed with its redis extra into a fresh venv that has no
torch (its dependencies from PyPI), serves a request relayed to the fault upstream, a cache
hit and a row in its SQLite log. The venv is made once per session (pip: about 20 s)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from fault_upstream import FaultUpstream
from packaging.requirements import Requirement

from infire.serverproc import ServerProcess, free_port

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (3.10)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gateway-dist"))

from build_wheel import FILES, build_wheel  # noqa: E402

ENGINE_MODULES = ("torch", "numpy", "tokenizers", "gguf", "safetensors", "fastapi")
# Nothing of this checkout may leak into the venv's processes.
CLEAN_ENV = {"PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("gateway-wheel"))


@pytest.fixture(scope="session")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no system site-packages) with `infire-gateway[redis]` installed."""
    folder = tmp_path_factory.mktemp("gateway-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True,
                   timeout=120)  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "--python", str(folder / "bin" / "python"),
                    "install", "--quiet", "--disable-pip-version-check", f"{wheel}[redis]"],
                   check=True, timeout=600)  # fmt: skip
    return folder


def _run(venv: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / command[0]), *command[1:]], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **CLEAN_ENV})  # fmt: skip


def test_the_wheel_holds_the_gateway_and_nothing_of_the_engine(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    package = {n for n in names if n.startswith("infire/")}
    shipped = {n.split("/")[1] for n in package}
    assert shipped == set(FILES)
    assert "infire/gateway/dashboard.html" in package
    assert not any("__pycache__" in n for n in names)


def test_its_dependencies_keep_the_main_packages_bounds():
    def requirements(path: Path, extra: str) -> dict[str, Requirement]:
        project = tomllib.loads(path.read_text())["project"]
        found = project["dependencies"] + project["optional-dependencies"][extra]
        return {r.name: r for r in map(Requirement, found)}

    main = requirements(ROOT / "pyproject.toml", "gateway")
    gateway = requirements(ROOT / "gateway-dist" / "pyproject.toml", "redis")
    assert not set(gateway) & {"torch", "numpy", "tokenizers", "gguf", "safetensors"}
    assert set(gateway) - set(main) == {"starlette"}  # which comes with FastAPI there
    for name, requirement in gateway.items():
        if name in main:
            assert str(requirement) == str(main[name]), name


def test_the_venv_has_no_engine(venv: Path):
    modules = (*ENGINE_MODULES, "redis", "infire")
    probe = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) "
             f"is not None for m in {modules!r}}}))")  # fmt: skip
    found = json.loads(_run(venv, "python", "-c", probe).stdout)
    assert found == {**dict.fromkeys(ENGINE_MODULES, False), "redis": True, "infire": True}
    torch = _run(venv, "python", "-c", "import torch")
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    where = _run(venv, "python", "-c", "import infire.gateway; print(infire.gateway.__file__)")
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr


def test_the_engine_commands_say_what_to_install(venv: Path):
    assert _run(venv, "infire", "gateway", "--help").returncode == 0
    serve = _run(venv, "infire", "serve")
    assert serve.returncode == 2, serve.stderr
    assert "pip install infire" in serve.stderr and "Traceback" not in serve.stderr


def test_relay_cache_hit_and_log_row(venv: Path, tmp_path: Path):
    body = {"model": "up/fault-model",
            "messages": [{"role": "user", "content": "hello from a small box"}]}  # fmt: skip
    with FaultUpstream() as upstream:
        config = tmp_path / "gateway.toml"
        config.write_text(f"""
[store]
path = "gateway.db"
[gateways.edge]
cache_ttl_s = 60
[providers.up]
kind = "openai"
base_url = "{upstream.base_url}"
[prices."up/fault-model"]
input = 1.0
output = 2.0
""")  # fmt: skip
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [str(venv / "bin" / "infire"), "gateway", "--config", str(config),
                   "--port", str(port)]  # fmt: skip
        with ServerProcess("infire gateway (infire-gateway)", command, port, f"{url}/health",
                           log=tmp_path / "gateway.log", env=CLEAN_ENV):  # fmt: skip
            first = httpx.post(f"{url}/edge/compat/chat/completions", json=body, timeout=30)
            second = httpx.post(f"{url}/edge/compat/chat/completions", json=body, timeout=30)
            row = _log_row(url, first.headers["cf-aig-log-id"])
        calls = upstream.calls()
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"] == "echo: hello from a small box"
    assert first.headers["cf-aig-cache-status"] == "MISS"
    assert second.headers["cf-aig-cache-status"] == "HIT" and second.content == first.content
    assert len(calls) == 1  # the hit never reached the upstream
    assert row["status"] == 200 and row["provider"] == "up" and row["model"] == "fault-model"
    assert row["tokens_in"] > 0 and row["cost"] > 0
    with sqlite3.connect(tmp_path / "gateway.db") as db:  # what the stopped gateway left
        rows = db.execute("SELECT status, cache_status, id FROM requests ORDER BY created")
        logged = rows.fetchall()
    assert logged == [(200, "MISS", first.headers["cf-aig-log-id"]),
                      (200, "HIT", second.headers["cf-aig-log-id"])]  # fmt: skip


def _log_row(url: str, log_id: str) -> dict:
    """The call's row from the log route (it is written just after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{url}/edge/logs/{log_id}", timeout=10)
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.05)
