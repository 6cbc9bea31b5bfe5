"""Rendering a request's own `chat_template` (only with --allow-request-chat-template).

A template is a program the client wrote, run on the server. It runs in jinja2's immutable
sandbox (no attribute tricks, no mutation of the values it gets) in a tokenizer-pool thread,
within a budget:

- time: a trace function checks the deadline on every line the compiled template executes,
  so no loop can run past `timeout` seconds;
- size: the output and every string or list the template builds are bounded by `max_chars`
  (checked on the same line events), and the single operations that could allocate past it
  in one go (`*`, `**`, `%`, width arguments like ljust(10**9), and the filters and globals
  that pad or generate text) are refused or checked before they run.

A template over budget or broken gets a 400 naming `chat_template`.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quire.entrypoints.chat_continuation import cut_at_tag, tag_final_message, template_rejected
from quire.entrypoints.errors import OpenAIError, bad_request

MAX_EXPONENT = 1024        # `a ** b` beyond this is refused: huge integers cost time and memory
UNSAFE_FILTERS = ("center", "indent", "wordwrap", "format", "filesizeformat", "urlize")
UNSAFE_GLOBALS = ("lipsum",)


class BudgetExceeded(Exception):
    pass


class _CheckedConcat(CodeGenerator):
    """`a ~ b` goes through environment.checked_join, which refuses results past the budget
    before building them (jinja compiles it to a plain str.join otherwise)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CheckedConcat

    def __init__(self, deadline: float, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.deadline, self.max_chars = deadline, max_chars
        for name in UNSAFE_FILTERS:
            self.filters.pop(name, None)
        self.filters["replace"] = self.checked_replace
        self.filters["join"] = self.checked_join_filter
        for name in UNSAFE_GLOBALS:
            self.globals.pop(name, None)
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded("it ran past its time budget (--chat-template-timeout)")

    def check_size(self, n: int) -> None:
        if n > self.max_chars:
            raise BudgetExceeded("it builds a value past its size budget")

    def checked_join(self, parts) -> str:
        parts = [str(p) for p in parts]
        self.check_size(sum(map(len, parts)))
        return "".join(parts)

    def checked_join_filter(self, value, d: str = "", attribute=None) -> str:
        parts = [str(v[attribute] if attribute is not None else v) for v in value]
        self.check_size(sum(map(len, parts)) + len(d) * max(0, len(parts) - 1))
        return d.join(parts)

    def checked_replace(self, s, old, new, count=-1) -> str:
        s, old, new = str(s), str(old), str(new)
        hits = s.count(old) if count < 0 else min(count, s.count(old))
        self.check_size(len(s) + hits * max(0, len(new) - len(old)) + (len(new) if not old else 0) * len(s))
        return s.replace(old, new, count)

    def call_binop(self, context, operator, left, right):
        self.check_time()
        if operator == "+" and isinstance(left, (str, list, tuple)) \
                and isinstance(right, (str, list, tuple)):
            self.check_size(len(left) + len(right))
        if operator == "%" and isinstance(left, str):
            raise SecurityError("string formatting with % is not allowed")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponents above {MAX_EXPONENT} are not allowed")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > self.max_chars:
                    raise BudgetExceeded("it builds a value past its size budget")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        __self.check_time()
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and a > __self.max_chars:
                raise BudgetExceeded(f"an argument of {a} is past its size budget")
        name = getattr(__obj, "__name__", None)
        if name in ("format", "format_map"):
            raise SecurityError("str.format is not allowed")
        if isinstance(getattr(__obj, "__self__", None), str) and name in ("replace", "join"):
            return getattr(__self, "checked_" + name)(*((__obj.__self__, *args) if name ==
                                                       "replace" else args))
        return super().call(__context, __obj, *args, **kwargs)


def _raise(message: str):
    raise TemplateError(message)


def render(template: str, conversation: list[dict], add_generation_prompt: bool,
           special_tokens: dict[str, str], timeout: float, max_chars: int,
           extra: dict | None = None, continue_final_message: bool = False) -> str:
    """The rendered prompt, or OpenAIError 400 naming chat_template. `extra`: more template
    variables (the request's `tools` and chat_template_kwargs); `continue_final_message`: the
    prompt ends inside the last message (chat_continuation)."""
    if continue_final_message:
        try:
            conversation = tag_final_message(conversation)
        except ValueError as e:
            raise template_rejected(e) from None
    env = _BudgetedSandbox(time.monotonic() + timeout, max_chars)
    tracer = _Tracer(env)
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        compiled = env.from_string(template)
        pieces, size = [], 0
        # extra over the special tokens, as transformers' apply_chat_template merges them
        for piece in compiled.generate(messages=conversation,
                                       add_generation_prompt=add_generation_prompt,
                                       **{**special_tokens, **(extra or {})}):
            size += len(piece)
            if size > max_chars:
                raise BudgetExceeded("its output is past its size budget")
            pieces.append(piece)
        text = "".join(pieces)
    except BudgetExceeded as e:
        raise _rejected(f"the chat template was stopped: {e}") from None
    except (TemplateError, SecurityError) as e:
        raise _rejected(f"the chat template failed: {e}") from None
    except (RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
            AttributeError, KeyError, IndexError) as e:
        raise _rejected(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
    if not continue_final_message:
        return text
    try:
        return cut_at_tag(text)
    except ValueError as e:
        raise template_rejected(e) from None


def _rejected(message: str) -> OpenAIError:
    return bad_request(message[:500], "chat_template")


class _Tracer:
    """sys.settrace hook: on each line of the compiled template, check the time and the size
    of what its locals hold. Other code (jinja itself) is not traced line by line."""

    def __init__(self, env: _BudgetedSandbox) -> None:
        self.env = env

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != "<template>":
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.env.check_time()
            for value in frame.f_locals.values():
                if isinstance(value, (str, list, dict)) and len(value) > self.env.max_chars:
                    raise BudgetExceeded("it builds a value past its size budget")
        return self._line
