"""`quire` with a sabotaged engine, for the tests of failures inside the engine.

A request whose prompt is "__poison__" gets detokenizers that raise (a failure of that request
alone); adding one whose prompt is "__die__" arms the engine: its next step raises, as a bug in
the scheduler would, and the loop dies. Everything else is the real `quire serve`.
"""

import sys

from quire.engine.engine import LLMEngine
from quire.entrypoints.cli import main

_add, _step = LLMEngine.add_request, LLMEngine.step


def add_request(self, request_id, prompt, *args, **kwargs):
    result = _add(self, request_id, prompt, *args, **kwargs)
    if prompt == "__die__":
        self.armed_to_die = True
    if prompt == "__poison__":
        for detok in self.output_processor.group_of(request_id).detoks:
            detok.update = _surprise
    return result


def _surprise(token_id):
    raise RuntimeError("injected detokenizer surprise")


def step(self):
    if getattr(self, "armed_to_die", False):
        raise RuntimeError("injected fault: the engine loop dies")
    return _step(self)


LLMEngine.add_request, LLMEngine.step = add_request, step

if __name__ == "__main__":
    sys.exit(main())
