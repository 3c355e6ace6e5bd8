"""torch stays optional: ``import fastper`` never imports it, and a missing torch says what to install."""

from __future__ import annotations

import subprocess
import sys


def test_import_fastper_does_not_import_torch_or_the_device_package() -> None:
    code = (
        "import sys, fastper, fastper.storage, fastper.checkpoint; "
        "bad = [m for m in ('torch', 'fastper.device') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_missing_torch_gives_an_install_hint() -> None:
    # a meta-path finder that hides torch, as on a machine without it
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('No module named torch')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "try:\n"
        "    import fastper.device\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.startswith("fastper.device needs the torch extra ("), proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith('pip install "fastper[torch]" (in a clone: pip install -e ".[torch]")'), proc.stdout
    assert proc.stdout.count("\n") == 1  # one line
