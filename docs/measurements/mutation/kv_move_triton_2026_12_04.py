# Hand-written mutants of vllm_anisotropic/attention/kv_move_triton.py against tests/test_kv_moves.py::test_triton_moves_follow_the_definition_in_the_interpreter
# (scripts/mutate.py forks in-process; this test runs Triton's interpreter in a fresh process, so each mutant is a copied package on PYTHONPATH).
# Run from the repository root: .venv/bin/python docs/measurements/mutation/kv_move_triton_2026_12_04.py
import os, re, shutil, subprocess, sys
sys.path.insert(0, "tests")
from test_kv_moves import _TRITON_MOVES
src = open("vllm_anisotropic/attention/kv_move_triton.py").read()
mutants = [
    ("identity", "keep = d < RUN", "keep = d < RUN", None, None),
    ("scatter before gather", "TO_BUF=True, RUN=run", "TO_BUF=False, RUN=run", "TO_BUF=False, RUN=run,\n                     RUN_POW2=pow2)\n", None),
    ("token = slot // block_size", "+ slot % block_size", "+ slot // block_size", None, None),
    ("no head stride", "* num_heads + head) * block_size", "+ head) * block_size", None, None),
    ("mask d <= RUN", "keep = d < RUN", "keep = d <= RUN", None, None),
    ("offsets in bytes", "offsets.append(delta // size)", "offsets.append(delta)", None, None),
    ("buffer without the layer", "((layer.to(tl.int64) * num_moves + move)", "((move)", None, None),
    ("buffer without the move", "* num_moves + move) * num_heads", "* num_moves) * num_heads", None, None),
    ("shape check dropped", "or cache.shape != first.shape", "", None, None),
    ("contiguity check dropped", "if not cache.is_contiguous():", "if False:", None, None),
]
killed = 0
for name, a, b, _, _ in mutants:
    if name == "scatter before gather":
        m = src.replace("TO_BUF=True, RUN=run", "TO_BUF=@@, RUN=run").replace("TO_BUF=False, RUN=run", "TO_BUF=True, RUN=run").replace("TO_BUF=@@, RUN=run", "TO_BUF=False, RUN=run")
    else:
        assert a in src, name
        m = src.replace(a, b)
    root = "/tmp/mut"; shutil.rmtree(root, ignore_errors=True)
    shutil.copytree("vllm_anisotropic", root + "/vllm_anisotropic", ignore=shutil.ignore_patterns("__pycache__"))
    open(root + "/vllm_anisotropic/attention/kv_move_triton.py", "w").write(m)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    try:
        out = subprocess.run([sys.executable, "-c", _TRITON_MOVES, os.path.abspath("tests")], env=env,
                             capture_output=True, text=True, timeout=120, cwd="/tmp")
        ok = out.returncode == 0 and out.stdout.strip().endswith("ok") and out.stdout.count("refused:") == 2
    except subprocess.TimeoutExpired:  # a hang (wild addresses in the interpreter) counts as killed
        ok = False
        name += " (timeout)"
    killed += not ok
    print(f"{'survived' if ok else 'killed  '} {name}", flush=True)
print(f"{killed}/{len(mutants)} killed")
