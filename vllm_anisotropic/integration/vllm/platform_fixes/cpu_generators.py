"""Seeded requests on vLLM's CPU engine: a per-request generator whose sampling step can be undone.

Why: vLLM 0.32's model runner samples every request of a step, then drops the sample of a
request whose prompt is still being prefilled in chunks, and rewinds that request's generator
so that its next draw is the one the dropped sample took (``GPUModelRunner._bookkeeping_sync``:
``gen.set_offset(gen.get_offset() - 4)``, one Philox draw of a CUDA generator). A CPU generator
(Mersenne Twister) has no offset: both calls raise "CPU Generator does not use offset", the
engine core dies and every request in flight fails. It happens to any seeded request whose
prompt does not fit one step's token budget (a long prompt, or many requests arriving at once),
in plain decoding as with trees.

The fix: ``StepRewindGenerator``, a CPU ``torch.Generator`` that remembers its state at the
start of a sampling step (``mark``, which patches.py patch 10 calls before the runner samples,
for the requests whose sample vLLM will drop) and whose ``set_offset(get_offset() - 4)``
restores it. The dropped draw is undone
exactly, as on CUDA: a seeded request draws the same tokens however its prompt was split into
chunks, which depends on the other requests of the batch.

No vLLM import here.
"""

from __future__ import annotations

import torch

__all__ = ["StepRewindGenerator", "rewindable"]


class StepRewindGenerator(torch.Generator):
    """A CPU generator whose offset counts sampling steps: ``STEP`` per ``mark``; setting it one
    step back restores the state ``mark`` saved. Any other offset raises (the draws of a step
    cannot be undone piecemeal, nor more than one step)."""

    STEP = 4  # what vLLM subtracts to undo one sample (a Philox offset on CUDA)

    def __init__(self, device="cpu") -> None:  # torch.Generator.__new__ takes the device
        self._steps = 0
        self._before: torch.Tensor | None = None

    @classmethod
    def copy_of(cls, source: torch.Generator) -> "StepRewindGenerator":
        """A generator that draws what ``source`` would draw next (same state, same seed)."""
        gen = cls("cpu")
        gen.set_state(source.get_state())
        return gen

    def mark(self) -> None:
        """A sampling step starts: remember the state its draws start from."""
        self._before = self.get_state()
        self._steps += 1

    def get_offset(self) -> int:
        return self._steps * self.STEP

    def set_offset(self, offset: int) -> None:
        if self._before is None or offset != (self._steps - 1) * self.STEP:
            raise RuntimeError(
                f"StepRewindGenerator.set_offset({offset}): only the last sampling step can be undone, "
                f"set_offset({(self._steps - 1) * self.STEP}) (get_offset() is {self.get_offset()}"
                f"{'' if self._before is not None else ', and no step has been marked since the last undo'})")
        self.set_state(self._before)
        self._before = None
        self._steps -= 1


def rewindable(generator):
    """``generator`` as a ``StepRewindGenerator`` when it is a plain CPU ``torch.Generator``;
    anything else (None, a CUDA generator, one already converted) unchanged."""
    if type(generator) is torch.Generator and generator.device.type == "cpu":
        return StepRewindGenerator.copy_of(generator)
    return generator
