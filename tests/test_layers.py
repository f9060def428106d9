"""The layers of pyproject.toml's import-linter contract hold (tools on the API, the API on the
step, the step on its parts, models and ops at the bottom; no import circle; no ignore list), and
importing graft_tk loads no tool."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("graft_tk.cli", "graft_tk.server", "graft_tk.calibration", "graft_tk.bench", "graft_tk.training",
         "graft_tk.autotune.tree_attention")


def test_the_layers_contract_is_kept_with_no_ignored_import(capsys):
    from importlinter.cli import lint_imports
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert contracts and not any(c.get("ignore_imports") for c in contracts)
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    out = capsys.readouterr().out
    assert code == 0 and "0 broken" in out, out[-3000:]


def test_importing_graft_tk_loads_no_tool():
    code = "import sys, graft_tk; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "graft_tk.decode" in loaded
    assert [m for m in loaded if m.startswith(TOOLS)] == []
