"""The next step's drafts travel with the step's output (patches.py patch 6): the tree
scheduler applies them in ``update_from_output`` and the engine core skips vLLM's second RPC
of the step (``take_draft_token_ids`` in ``EngineCore.post_step``); any other scheduler keeps
vLLM's RPC.

What each test would catch: a patch that is not installed or skips the RPC for every
scheduler (plain vLLM's ngram / EAGLE would lose their drafts); a tree scheduler that no longer
applies the drafts it was sent (every tree step without drafts: the engine tests' tau > 1 fails
too) or applies drafts that never came. That the runner sends them is covered by every engine
test with tau > 1: with the RPC skipped, no other path delivers drafts."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_anisotropic.integration.vllm.frontdoor import patches


class _Recorder:
    def __init__(self, drafts):
        self.drafts, self.taken, self.applied = drafts, 0, []

    def take_draft_token_ids(self):
        self.taken += 1
        return self.drafts

    def update_draft_token_ids(self, drafts):
        self.applied.append(drafts)


def _core(scheduler, executor):
    return SimpleNamespace(scheduler=scheduler, model_executor=executor, check_for_draft_tokens=True,
                           async_scheduling=False)


def test_post_step_skips_the_rpc_for_the_tree_scheduler_only():
    from vllm.v1.engine.core import EngineCore

    assert patches.apply()
    drafts = SimpleNamespace(req_ids=["a"], draft_token_ids=[[1, 2]])

    tree_executor, tree_scheduler = _Recorder(drafts), SimpleNamespace(drafts_arrive_with_output=True)
    EngineCore.post_step(_core(tree_scheduler, tree_executor), True)
    assert tree_executor.taken == 0

    executor, scheduler = _Recorder(drafts), _Recorder(None)
    EngineCore.post_step(_core(scheduler, executor), True)
    assert executor.taken == 1 and scheduler.applied == [drafts]


def test_tree_scheduler_applies_the_drafts_sent_with_the_output():
    from vllm_anisotropic.integration.vllm.engine.scheduler import TreeScheduler

    assert TreeScheduler.drafts_arrive_with_output
    drafts = SimpleNamespace(req_ids=["a"], draft_token_ids=[[1, 2]])
    scheduler, outputs = _Recorder(None), object()
    assert TreeScheduler._apply_drafts(scheduler, SimpleNamespace(tree_drafts=drafts), outputs) is outputs
    assert scheduler.applied == [drafts]
    TreeScheduler._apply_drafts(scheduler, SimpleNamespace(), outputs)  # none sent: nothing applied
    assert scheduler.applied == [drafts]
