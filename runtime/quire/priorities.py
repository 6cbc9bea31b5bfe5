"""Request priorities' shared names (neutral ground: the config, the engine's queue policy,
the server and the router all read them; none imports the engine for them).

vLLM's request priority: lower is served first under `--scheduling-policy priority`. The range
is GIE's InferenceObjective priority's (an int32), so one contract runs from the gateway to
the engine. (The router's own priorities are GIE's, higher first: router/objectives.py.)
"""

SCHEDULING_POLICIES = ("fcfs", "priority")
MIN_PRIORITY = -(2 ** 31)
MAX_PRIORITY = 2 ** 31 - 1


def check_priority(priority) -> None:
    """A request's priority: an integer in [MIN_PRIORITY, MAX_PRIORITY] (QuireValidationError
    naming `priority` otherwise)."""
    from quire.validation import check_int
    check_int("priority", priority, MIN_PRIORITY, MAX_PRIORITY,
              f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
