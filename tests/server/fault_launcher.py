"""`quire` with a sabotaged engine, for the tests of failures inside the engine and of
requests that must not finish on their own.

The server hands the engine token ids, so prompts are recognized by their decoded text:
- "__poison__" (anywhere in it): the request gets detokenizers that raise (a failure of that request alone);
- "__reject__": the request's first token is refused as a grammar refuses one (the sequence
  ends with finish_reason "error" and no message of its own);
- "__die__": arms the engine: its next step raises, as a bug in the scheduler would;
- a prompt holding "__slow__": while such a request is running, every step sleeps
  SLOW_STEP seconds, so it cannot finish sooner than max_tokens x SLOW_STEP, however fast the
  machine is (the tests' "long" requests).
A prompt that reaches the engine as a string is logged as an ERROR: the server must tokenize
in its own pool, never on the engine thread. Everything else is the real `quire serve`.
"""

import logging
import sys
import time

from quire.engine.engine import LLMEngine
from quire.engine.request import RequestStatus
from quire.entrypoints.cli import main

SLOW_STEP = 0.05  # seconds
logger = logging.getLogger("fault_launcher")
_add, _step = LLMEngine.add_request, LLMEngine.step


def add_request(self, request_id, prompt, *args, **kwargs):
    if isinstance(prompt, str):
        logger.error("a string prompt reached the engine thread (request %s)", request_id)
    result = _add(self, request_id, prompt, *args, **kwargs)
    text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
    if "__die__" in text:
        self.armed_to_die = True
    if "__poison__" in text:
        for detok in self.output_processor.group_of(request_id).detoks:
            detok.update = _surprise
    if "__reject__" in text:
        self.__dict__.setdefault("rejected", set()).add(request_id)
        if "advance" not in self.structured.__dict__:
            self.structured.advance = _rejecting(self, self.structured.advance)
    if "__slow__" in text:
        self.__dict__.setdefault("slow_requests", set()).add(request_id)
    return result


def _rejecting(engine, advance):
    """The structured manager's advance, refusing the marked requests' tokens as a grammar
    that rejects one does: the sequence is finished with an error status, nothing else."""
    def wrapped(seqs, scheduler=None):
        for seq in seqs:
            if seq.client_request_id in engine.rejected and scheduler is not None \
                    and not seq.finished:
                logger.error("request %s: token rejected (injected)", seq.request_id)
                scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
        return advance(seqs, scheduler)
    return wrapped


def _surprise(token_id):
    raise RuntimeError("injected detokenizer surprise")


def step(self):
    if getattr(self, "armed_to_die", False):
        raise RuntimeError("injected fault: the engine loop dies")
    slow = getattr(self, "slow_requests", None)
    if slow:
        slow.intersection_update(self.output_processor.groups)  # forget finished ones
        if any(r.client_request_id in slow for r in self.scheduler.running):
            time.sleep(SLOW_STEP)
    return _step(self)


LLMEngine.add_request, LLMEngine.step = add_request, step

if __name__ == "__main__":
    sys.exit(main())
