"""Drive an LLM engine (V1 multiprocessing on, as the bench) closed-loop at C requests; print tokens/s
and the CPU seconds of this process and of each child process over the timed batch.
usage: mp_drive.py METHOD C NPROMPTS"""
import sys, time, tempfile, os
from pathlib import Path
import psutil
from vllm import LLM, SamplingParams
from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
from vllm_anisotropic.bench.sweep import resolve_config, method_llm_kwargs
from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS
from vllm_anisotropic.bench.sweep_engine import closed_loop
def main():
    method, conc, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = _resolve_model("smollm2-135m")
    prompts = build_prompts(model, "mbpp,math500", n)
    spec = resolve_config(method, Path(tempfile.mkdtemp()), None)
    llm = LLM(model=str(model), speculative_config=spec, max_num_seqs=conc, disable_log_stats=False,
              **{**CPU_LLM_DEFAULTS, **method_llm_kwargs(method)})
    eng = llm.llm_engine
    closed_loop(eng, prompts[:conc], SamplingParams(max_tokens=16, temperature=0.0), conc, "warm")
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    def cpu():
        out = {}
        for p in procs:
            try:
                t = p.cpu_times(); out[f"{p.pid}:{p.name()[:20]}"] = t.user + t.system
            except psutil.Error:
                pass
        return out
    spies = []
    if os.environ.get("PYSPY"):
        import subprocess
        for p in procs[1:]:
            name = p.name().replace("VLLM::", "").replace(":", "")
            if name in ("EngineCore", "Worker"):
                spies.append(subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(p.pid),
                    "-d", os.environ["PYSPY"], "-r", "50", "--idle", "--nonblocking", "-f", "raw",
                    "-o", f"/tmp/spy_{method}_{name}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    c0 = cpu()
    outs, secs = closed_loop(eng, prompts, SamplingParams(max_tokens=128, temperature=0.0), conc, "run")
    c1 = cpu()
    tok = sum(len(o) for o in outs)
    used = {k: round(c1[k] - c0[k], 2) for k in c1 if k in c0}
    for sp in spies: sp.wait()
    print(f"RESULT {method} c{conc}: {tok} tokens in {secs:.2f} s = {tok/secs:.1f} tokens/s; cpu s {used}", flush=True)

if __name__ == '__main__':
    main()
