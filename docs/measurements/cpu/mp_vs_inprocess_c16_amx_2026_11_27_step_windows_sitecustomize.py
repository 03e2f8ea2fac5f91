import os
if os.environ.get("SL2_OUT"):
    import time, json, functools, sys
    _LOG = None
    def _log(d):
        global _LOG
        if _LOG is None:
            _LOG = open(os.environ["SL2_OUT"] + f".{os.getpid()}", "w", buffering=1)
        _LOG.write(json.dumps(d) + "\n")
    import importlib.abc, importlib.machinery
    _state = {"t_end": None}
    def _patch_runner():
        tree = os.environ.get("SL2_TREE") == "1"
        if tree:
            from vllm_anisotropic.integration.vllm.runner import TreeCPUModelRunner as Rn
        else:
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner as Rn
        ex, st = Rn.execute_model, Rn.sample_tokens
        @functools.wraps(ex)
        def execute_model(self, so, *a, **k):
            t0 = time.perf_counter()
            gap = None if _state["t_end"] is None else t0 - _state["t_end"]
            r = ex(self, so, *a, **k)
            _state["exec"] = (time.perf_counter() - t0, gap, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                              sum(len(v) for v in so.scheduled_spec_decode_tokens.values()), len(so.scheduled_new_reqs))
            return r
        @functools.wraps(st)
        def sample_tokens(self, g):
            t0 = time.perf_counter()
            r = st(self, g)
            t1 = time.perf_counter()
            e = _state.pop("exec", None)
            if e is not None and e[2]:
                _log(dict(w=1, exec=e[0], gap=e[1], R=e[2], Q=e[3], ndraft=e[4], new=e[5], samp=t1 - t0, t=t1))
            _state["t_end"] = time.perf_counter()
            return r
        Rn.execute_model, Rn.sample_tokens = execute_model, sample_tokens
    def _patch_sched():
        from vllm.v1.core.sched.scheduler import Scheduler as S
        sch, upd = S.schedule, S.update_from_output
        @functools.wraps(sch)
        def schedule(self, *a, **k):
            self._sl_t0 = time.perf_counter(); so = sch(self, *a, **k); self._sl_t1 = time.perf_counter(); return so
        @functools.wraps(upd)
        def update_from_output(self, so, mro):
            t0 = time.perf_counter(); r = upd(self, so, mro); t1 = time.perf_counter()
            if so.num_scheduled_tokens:
                _log(dict(s=1, R=len(so.num_scheduled_tokens), Q=so.total_num_scheduled_tokens, new=len(so.scheduled_new_reqs),
                          ndraft=sum(len(v) for v in so.scheduled_spec_decode_tokens.values()),
                          sched=self._sl_t1 - self._sl_t0, wait=t0 - self._sl_t1, upd=t1 - t0, step=t1 - self._sl_t0, t=t1))
            return r
        S.schedule, S.update_from_output = schedule, update_from_output
    class _Hook(importlib.abc.MetaPathFinder):
        done = set()
        def find_spec(self, name, path, target=None):
            if name in ("vllm.v1.worker.cpu_model_runner", "vllm.v1.core.sched.scheduler") and name not in self.done:
                self.done.add(name)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                if spec is None: return None
                orig = spec.loader.exec_module
                def exec_module(module, orig=orig, name=name):
                    orig(module)
                    try:
                        if name.endswith("scheduler"): _patch_sched()
                        elif os.environ.get("SL2_TREE") != "1": _patch_runner()
                    except Exception as e:
                        print("SL2 patch failed", name, e, file=sys.stderr)
                spec.loader.exec_module = exec_module
                return spec
            if name == "vllm_anisotropic.integration.vllm.runner" and os.environ.get("SL2_TREE") == "1" and name not in self.done:
                self.done.add(name)
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                orig = spec.loader.exec_module
                def exec_module(module, orig=orig):
                    orig(module)
                    try: _patch_runner()
                    except Exception as e: print("SL2 runner patch failed", e, file=sys.stderr)
                spec.loader.exec_module = exec_module
                return spec
            return None
    sys.meta_path.insert(0, _Hook())
