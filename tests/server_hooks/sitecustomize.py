"""Hooks into a server process started by a test, so no test races the server or the wall clock.

Loaded by Python at start where this directory is on ``PYTHONPATH`` (``tests/test_serve_resume.py`` and
``tests/test_serve.py`` start servers so):

- ``KVSTATE_TEST_CLOCK=PATH``: the service's clock (the MLX interpreter's, which idle rules read) is
  the number of seconds written in that file, which the test advances;
- ``KVSTATE_TEST_KILL=POINT``: the server kills itself (SIGKILL, as ``kill -9``) at an exact point of
  its work. The points:

- ``prefill``: at the first prompt chunk the batch computes (before any token);
- ``token:T``: once the T-th token's response is made;
- ``after-checkpoint-commit:N:T``: at the T-th token's response, once the N-th checkpoint file has
  been renamed to its own name (the generation waits there for that commit, then the process dies);
- ``before-checkpoint-commit:N:T``: the N-th checkpoint file is written and synced under its temporary
  name and not yet renamed (its write done, its commit not) when the process dies; the generation
  waits at the T-th token's response meanwhile, so the kill comes mid-generation.
"""

import os

CLOCK = os.environ.get("KVSTATE_TEST_CLOCK")

if CLOCK:
    from kvstate.interpreters.mlx import interpreter

    made = interpreter.MlxInterpreter.__init__

    def read_clock() -> float:
        with open(CLOCK) as seconds:
            return float(seconds.read())

    def made_on_the_tests_clock(self, *args, **kwargs):
        made(self, *args, **{**kwargs, "clock": read_clock})

    interpreter.MlxInterpreter.__init__ = made_on_the_tests_clock

POINT = os.environ.get("KVSTATE_TEST_KILL")

if POINT:
    import importlib
    import signal
    import threading

    kind, *numbers = POINT.split(":")

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def at_token(token: int, then) -> None:
        """Run ``then`` on the generation thread once the ``token``-th token's response is made."""
        server = importlib.import_module("mlx_lm.server")
        made, seen = server.Response.__init__, [0]

        def made_then(self, *args, **kwargs):
            made(self, *args, **kwargs)
            seen[0] += 1
            if seen[0] == token:
                then()

        server.Response.__init__ = made_then

    if kind == "prefill":
        generate = importlib.import_module("mlx_lm.generate")  # the package's ``generate`` is a function
        prompt = generate.PromptProcessingBatch.prompt

        def prompt_then_die(self, tokens):
            die()

        generate.PromptProcessingBatch.prompt = prompt_then_die
    elif kind == "token":
        at_token(int(numbers[0]), die)
    elif kind in ("before-checkpoint-commit", "after-checkpoint-commit"):
        checkpoint, token = int(numbers[0]), int(numbers[1])
        committed, replace, seen = threading.Event(), os.replace, [0]

        def replace_around_commit(source, target, *args, **kwargs):
            if not os.path.basename(str(target)).startswith("checkpoint-"):
                return replace(source, target, *args, **kwargs)
            seen[0] += 1
            if seen[0] == checkpoint and kind == "before-checkpoint-commit":
                die()
            replace(source, target, *args, **kwargs)
            if seen[0] == checkpoint:
                committed.set()

        os.replace = replace_around_commit
        if kind == "after-checkpoint-commit":
            at_token(token, lambda: (committed.wait(), die()))
        else:
            at_token(token, threading.Event().wait)  # parked until the writer's kill
    else:
        raise SystemExit(f"KVSTATE_TEST_KILL: no crash point {POINT!r}")
