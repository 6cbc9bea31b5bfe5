"""`quire` with a sabotaged engine, for the test that the engine loop's death is fatal.

Adding a request whose prompt is "__die__" arms the engine; its next step raises, as a bug in
the scheduler would. Everything else is the real `quire serve`.
"""

import sys

from quire.engine.engine import LLMEngine
from quire.entrypoints.cli import main

_add, _step = LLMEngine.add_request, LLMEngine.step


def add_request(self, request_id, prompt, *args, **kwargs):
    result = _add(self, request_id, prompt, *args, **kwargs)
    if prompt == "__die__":
        self.armed_to_die = True
    return result


def step(self):
    if getattr(self, "armed_to_die", False):
        raise RuntimeError("injected fault: the engine loop dies")
    return _step(self)


LLMEngine.add_request, LLMEngine.step = add_request, step

if __name__ == "__main__":
    sys.exit(main())
