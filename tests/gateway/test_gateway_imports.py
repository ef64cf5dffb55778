"""The gateway and the command line import nothing of the engine (issue 19): in a fresh
interpreter, `infire --help`, every subcommand's `--help` and `import infire.gateway` leave
torch, numpy, tokenizers and gguf out (`python -X importtime` lists every module imported),
while `from infire import LLM` still works for engine users."""

from __future__ import annotations

import subprocess
import sys

import pytest

ENGINE_MODULES = {"torch", "numpy", "tokenizers", "gguf"}
COMMANDS = ("infire", "infire gateway", "infire serve", "infire generate", "infire chat",
            "infire compress", "infire verify", "infire inspect", "infire balance",
            "infire bench serve")  # fmt: skip


def _imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The top-level modules a fresh interpreter imports running `python -X importtime args`."""
    result = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0]
               for line in result.stderr.splitlines() if line.startswith("import time:")}  # fmt: skip
    return modules, result


@pytest.mark.parametrize("command", COMMANDS)
def test_help_imports_no_engine(command: str):
    modules, result = _imported("-m", "infire.cli", *command.split()[1:], "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: infire" in result.stdout
    assert not modules & ENGINE_MODULES


def test_the_gateway_imports_no_engine():
    modules, result = _imported("-c", "import infire.gateway; infire.gateway.GatewayApp")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "starlette" in modules and not modules & ENGINE_MODULES
    assert "fastapi" not in modules and "pydantic" not in modules


def test_the_package_names_are_imported_on_first_use():
    code = ("import sys, infire; assert 'torch' not in sys.modules; "
            "from infire import LLM, SamplingParams; assert 'torch' in sys.modules; "
            "assert {'LLM', 'SamplingParams', 'RequestOutput'} <= set(dir(infire)); "
            "assert infire.LLM is LLM")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        import infire

        _ = infire.nothing_here
