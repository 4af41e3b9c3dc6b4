"""Test-side kill points for the soak (tests/test_soak.py): run ``mixprec train`` in a process that stops at a
chosen moment and waits there to be SIGKILLed.

Processes come from one ``multiprocessing`` fork server that has imported torch and mixprec once (and never
computed anything, so forking it is safe), so a restart costs a fork, not an interpreter start. In the child,
before the CLI runs, a few of mixprec's and torch's functions are wrapped *from here* so that the child tells
the test (a pipe) when it reached its kill point and then sleeps; the test kills it with SIGKILL at once. Product
code has no hook, switch or environment variable for any of this.

Kill points (``phase``, reached at the first occurrence on or after global step ``at``):

- ``forward``: inside the model's forward (after its first layer) of training step ``at`` or later;
- ``update``: after the backward, before the recipe unscales, checks and applies the step;
- ``save-write``: half of the checkpoint's bytes are in its temporary file (payload of step ``at`` or later);
- ``save-rename``: the temporary file is complete, not yet renamed over ``last.pt``;
- ``eval``: inside the evaluation's first forward, once ``at`` or more steps are done.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import sys
import time

PHASES = ("forward", "update", "save-write", "save-rename", "eval")

PRELOAD = ["killpoints", "torch", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.fsdp.sharded_grad_scaler", "torch.nn.parallel", "mixprec.cli", "mixprec.train.loop",
           "mixprec.train.build", "mixprec.train.distributed"]
"""What the fork server imports once: everything a training run imports (torch._dynamo comes with the optimizer)."""

_CTX = None


def context():
    """The fork server (started on first use, one thread per process, torch and mixprec imported)."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment, inherited by every child
        try:
            p = ctx.Process(target=_noop)  # starts the server now, with this environment
            p.start()
            p.join()
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _CTX = ctx
    return _CTX


def _noop():
    pass


def start(args, log_path, *, env=None, kill=None):
    """Start ``mixprec ARGS`` in a child; ``kill`` = ``{"phase", "at", "done"}`` (``done``: the global step it
    resumes from). Returns ``(process, connection)``: the connection receives one message when the child has
    reached its kill point."""
    ctx = context()
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(list(map(str, args)), str(log_path), dict(env or {}), kill, send))
    p.start()
    send.close()
    return p, recv


def wait(procs, conn, timeout):
    """Wait until the kill point is reached (returns its description) or every process has ended (None)."""
    deadline = time.monotonic() + timeout
    pending = [conn, *(p.sentinel for p in procs)]
    while any(w is not conn for w in pending):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no kill point and no exit in {timeout} s")
        ready = multiprocessing.connection.wait(pending, timeout=left)
        if conn in ready:
            try:
                return conn.recv()
            except EOFError:  # the child that held the sending end ended without reaching its kill point
                pass
        pending = [w for w in pending if w not in ready]
    return None


def _child(args, log_path, env, kill, conn):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    if kill is not None:
        _install(kill, conn)
    else:
        conn.close()
    from mixprec.cli import main

    code = main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _install(kill, conn):
    import torch

    import mixprec.train.loop as loop

    phase, at = kill["phase"], kill["at"]
    done = {"steps": kill["done"]}

    def pause(where):
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(where)
        while True:  # the test kills this process now
            time.sleep(3600)

    def first_leaf(model):
        return next(m for m in model.modules() if not list(m.children()))

    real_step = loop.accumulate_step

    def accumulate_step(ctx, micro_batches, *, step=None, tracker=None):
        if step is not None and step >= at:
            if phase == "forward":
                first_leaf(ctx.model).register_forward_hook(lambda *_: pause(f"forward of step {step}"))
            elif phase == "update":
                ctx.recipe.step = lambda *a, **k: pause(f"update of step {step}")
        result = real_step(ctx, micro_batches, step=step, tracker=tracker)
        done["steps"] = step + 1
        return result

    real_evaluate = loop.evaluate

    def evaluate(ctx, data, **kw):
        if phase == "eval" and done["steps"] >= at:
            first_leaf(ctx.model).register_forward_hook(lambda *_: pause(f"evaluation after step {done['steps']}"))
        return real_evaluate(ctx, data, **kw)

    real_save = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and "global_step" in obj and "model" in obj and obj["global_step"] >= at:
            where = f"save of step {obj['global_step']}"
            if phase == "save-write":
                buf = io.BytesIO()
                real_save(obj, buf, *a, **kw)
                data = buf.getvalue()
                f.write(data[:len(data) // 2])
                f.flush()
                pause(f"{where}: {len(data) // 2} of {len(data)} bytes written")
            if phase == "save-rename":
                real_save(obj, f, *a, **kw)
                f.flush()
                pause(f"{where}: written, not renamed")
        return real_save(obj, f, *a, **kw)

    loop.accumulate_step, loop.evaluate, torch.save = accumulate_step, evaluate, save
