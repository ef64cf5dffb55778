"""Build the infire-gateway wheel: the gateway alone, without the engine (no torch).

The distribution ships only FILES of src/infire. They are copied, with this folder's
pyproject.toml and README.md, into a temporary folder and built there by pip (setuptools),
so that no other file of the package and no build output ends up in the wheel or in the
checkout:

    python gateway-dist/build_wheel.py [--out dist]   # prints the wheel's path
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src" / "infire"
# What the gateway imports of infire: the lazy package, the errors, the error answers,
# the command line (its `infire gateway`) and the gateway itself.
FILES = ("__init__.py", "errors.py", "http_errors.py", "cli.py", "gateway")


def stage(folder: Path) -> Path:
    """The project to build, laid out in folder: pyproject.toml, README.md, src/infire/."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(HERE / name, folder / name)
    package = folder / "src" / "infire"
    package.mkdir(parents=True)
    for name in FILES:
        source = SRC / name
        if source.is_dir():
            shutil.copytree(source, package / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
        else:
            shutil.copy2(source, package / name)
    return folder


def build_wheel(out: Path) -> Path:
    """Build the wheel into out (made if missing); its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="infire-gateway-build-") as tmp:
        project = stage(Path(tmp))
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                   "--wheel-dir", str(project / "wheels"), str(project)]  # fmt: skip
        if importlib.util.find_spec("setuptools") is not None:
            command.insert(-1, "--no-build-isolation")  # this interpreter's setuptools
        subprocess.run(command, check=True, timeout=300)
        (wheel,) = (project / "wheels").glob("infire_gateway-*.whl")
        target = out / wheel.name
        shutil.copy2(wheel, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "dist",
                        help="where the wheel goes (default: dist/)")  # fmt: skip
    print(build_wheel(parser.parse_args().out))


if __name__ == "__main__":
    main()
