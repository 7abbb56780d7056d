"""longctx-bench profile with a patch module's apply() run first. Usage: prof_patched.py PATCH.py [profile args]"""
import importlib.util
import sys

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
spec = importlib.util.spec_from_file_location("patch", sys.argv[1]); patch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch)
patch.apply()
from longctx.bench import cli
sys.argv = ["longctx-bench", "profile"] + sys.argv[2:]
cli.main()
