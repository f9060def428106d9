"""Console scripts whose issues have not landed yet: they say so and exit with code 2."""
import sys


def _not_built(tool: str, what: str) -> int:
    print(f"{tool}: not built yet ({what}). Track the open issue for it; until then use graft-generate "
          "or the Python API (graft_tk.decode).", file=sys.stderr)
    return 2


def autotune() -> int:
    sys.exit(_not_built("graft-autotune", "persistent, shareable Triton config cache"))
