"""The one interface through which a per-request feature (structured output, speculation,
LoRA, beam search) takes part in a step. The scheduler owns the features and calls every
hook at its one place in the step; a feature keeps its per-request state in a store of its
own, keyed by sequence id, never on `Request`.

The hooks, in the order a step runs them (each is a no-op unless a feature needs it):

    add_request   added(seq)              a new sequence (and its pending siblings)
    schedule()    poll()                  [(seq, why)] found since the last step (a grammar
                                          that failed to compile): the engine fails them
                  propose(running)        {seq id: tokens to verify after its decode}
                  start_admission(running), may_admit(seq)
                                          a waiting sequence may start now (its grammar is
                                          compiled; its adapter fits max_loras: may take it)
                  runnable(seq)           the same question, asked without taking anything
                                          (priority preemption: is the head ready at all)
                  preempted(seqs)         these left their blocks (recompute or swap)
                  after_schedule(plan, running)
                                          the step's sequences are chosen: fill draft
                                          proposals, put adapters in slots; returns
                                          {seq id: why} for those that can't run
                  sampling_masks(rows, groups), decides_eos(seq id)
                                          the rows' grammar bitmask, applied before sampling
    update()      sampled(seqs, out, sampled, logprobs, scheduler) -> seqs
                                          each sequence's new tokens: verification counts; a
                                          beam search takes its beams (returns the rest)
    after_output  updated(seqs, scheduler)
                                          the text is done: grammars advance (and end
                                          answers: scheduler.finish, scheduler.end_answer)
    any time      finished(seqs)          these ended (finished, aborted, failed)
                  record(events)          move metrics into the step's events
                  waiting(), wait(timeout)
                                          work under way will make a waiting sequence
                                          runnable without a step (a grammar compiling)
"""

from __future__ import annotations


class Feature:
    def added(self, seq) -> None:
        pass

    def poll(self) -> list[tuple[object, str]]:
        return []

    def propose(self, running) -> dict[str, list[int]]:
        return {}

    def start_admission(self, running) -> None:
        pass

    def may_admit(self, seq) -> bool:
        return True

    def runnable(self, seq) -> bool:
        return True

    def preempted(self, seqs) -> None:
        pass

    def after_schedule(self, plan, running) -> dict[str, str]:
        return {}

    def sampling_masks(self, rows, groups):
        return None

    def decides_eos(self, seq_id: str) -> bool:
        return False

    def sampled(self, seqs, out, sampled, logprobs, scheduler):
        return seqs

    def updated(self, seqs, scheduler) -> None:
        pass

    def finished(self, seqs) -> None:
        pass

    def record(self, events) -> None:
        pass

    def waiting(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        pass
