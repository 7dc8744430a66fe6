"""Handlers the emulation tests deploy next to the real one."""


def crash(event, context):
    raise RuntimeError("boom")


def echo(event, context):
    import time

    time.sleep(event.get("sleep", 0) if isinstance(event, dict) else 0)
    return {"echo": event, "function": context.function_name,
            "remaining_ms": context.get_remaining_time_in_millis()}
