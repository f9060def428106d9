"""The wheel ships the product, not the lab: graft-bench and its modules, no experiment script, no
symlink; and graft-bench runs from the installed files alone."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = {p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = out.glob("graft_tk-*.whl")
    return path


def test_the_wheel_holds_graft_bench_and_no_lab_script_or_symlink(wheel):
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
    names = {i.filename for i in infos}
    assert {f"graft_tk/bench/{m}.py" for m in ("compare", "prompts", "anchors", "plots", "roofline")} <= names
    assert {"graft_tk/autotune/cache.py", "graft_tk/calibration/search.py"} <= names
    shipped = {Path(n).stem for n in names if n.endswith(".py")}
    assert not LAB & shipped, LAB & shipped                      # cases, gpu_check, compile_check, ...
    assert not [n for n in names if n.startswith("bench/")]
    assert not [i.filename for i in infos if (i.external_attr >> 16) & 0o170000 == 0o120000]


def test_graft_bench_runs_from_the_installed_files(wheel, tmp_path, smollm2_gguf):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); import graft_tk; "
            f"assert graft_tk.__file__.startswith({str(tmp_path)!r}), graft_tk.__file__; "
            "from graft_tk.cli.bench import main; "
            "sys.exit(main(['--model', 'smollm2-135m', '--dtype', 'fp32', '--methods', 'ar,retrieval', "
            "'--prompts', 'humaneval#1', '--max-new-tokens', '4', '--no-anchors']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "| retrieval |" in run.stdout
