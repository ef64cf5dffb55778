"""`infire gateway` as a real subprocess on a free port, with a gateway.toml written for it."""

from __future__ import annotations

import sys
from pathlib import Path

from infire.serverproc import ServerProcess, free_port


class Gateway(ServerProcess):
    """One `infire gateway` process serving `config` (TOML text) from `folder`."""

    def __init__(
        self, config: str, folder: Path, env: dict[str, str] | None = None, args: list[str] = ()
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / "gateway.toml"
        self.config_path.write_text(config)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "infire.cli", "gateway", "--config",
                   str(self.config_path), "--port", str(port), *args]  # fmt: skip
        super().__init__("infire gateway", command, port, f"{self.url}/health",
                         log=folder / "gateway.log", env=env)  # fmt: skip
