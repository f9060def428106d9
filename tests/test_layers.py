"""The layers of pyproject.toml's import-linter contract hold (tools on the API, the API on the
step, the step on its parts, models and ops at the bottom; no import circle; no ignore list), and
importing graft_tk loads no tool; and the step's own contracts: the batch and the step never see
the engine, never name a source, never fork on one request, never compare a compile scope as a string."""
import ast
import re
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


def test_the_step_the_batch_and_the_engine_name_no_source_and_never_fork_on_one_request():
    from graft_tk.sources import registered
    package = ROOT / "graft_tk"
    for module in ("step.py", "batch.py", "engine.py"):
        text = (package / module).read_text()
        assert not [n for n in registered() if re.search(rf"\b{n}\b", text)], module
    for module in ("step.py", "batch.py"):     # no name, argument or attribute called engine
        tree = ast.parse((package / module).read_text())
        names = {getattr(node, "id", None) or getattr(node, "arg", None) or getattr(node, "attr", None)
                 for node in ast.walk(tree) if isinstance(node, (ast.Name, ast.arg, ast.Attribute))}
        assert "engine" not in names, f"{module} reaches the engine"
    step = (package / "step.py").read_text()
    assert not re.search(r"(B|len\(rows\)) *== *1\b", step), "the step forks on a request decoding alone"


def test_no_compile_scope_or_run_variant_is_compared_as_a_string():
    pattern = re.compile(r"""compile\w* *(==|!=|is|in) *\(?["']|(endswith|removesuffix)\((["']:|\w*SUFFIX)""")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "graft_tk").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
