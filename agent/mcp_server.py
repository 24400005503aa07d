"""``kernelloop mcp``: the judge as a Model Context Protocol server on stdio, for coding agents.

Built on the official Python SDK's ``MCPServer`` (package ``mcp``); the protocol is the SDK's.
Tools: ``list_tasks``, ``show_task``, ``evaluate``, ``baseline``, ``history``; what they do is
``agent.mcp_session.AgentSession``'s (one per client: its name comes from the handshake's
``clientInfo``). ``evaluate`` reports its stages as progress notifications (build, checks,
timing) from ``sandbox.phases``; cancelled by the client, or ended because the client went away
(its stdin closed), it kills the evaluation's workers and stores no verdict for it.
"""
import queue
import sys
import threading
from typing import Any, Optional

import typer

from kernelloop.cli_common import DbOption, fail, open_store

# No ``from __future__ import annotations`` here: the SDK reads the tools' signatures, whose
# ``Context`` is imported where the tools are defined (the SDK is imported only when serving).

# Stages of sandbox.phases -> (progress step of 4, what is happening); stages not listed keep the last.
STAGES = {
    "build_wait": (0, "build: compiling the candidate"),
    "reference": (1, "checks: starting the reference"),
    "load_wait": (1, "checks: waiting to load the candidate (a timing holds the device)"),
    "load": (1, "checks: loading the candidate"),
    "trials": (2, "checks: trials against the reference on secret inputs"),
    "timing": (3, "timing: the candidate and the reference"),
    "spot_checks": (3, "timing: checking the timed runs' outputs"),
    "profile": (3, "timing: profiling the candidate"),
}
STEPS = 4

INSTRUCTIONS = (
    "kernelloop judges PyTorch kernels: evaluate(task, source) builds the candidate module (which defines "
    "class ModelNew), checks it against the task's reference Model on secret inputs, times it as KernelBench "
    "does against eager PyTorch and torch.compile, flags cheats, and explains the verdict from measured "
    "evidence. list_tasks and show_task find tasks; history lists this session's attempts, best first.")


def _client(ctx: Any) -> tuple[str, Optional[str]]:
    params = getattr(ctx.session, "client_params", None)
    info = getattr(params, "client_info", None)
    return (getattr(info, "name", None) or "unknown"), getattr(info, "version", None)


def build_server(store: Any, options: Any) -> tuple[Any, dict[str, Any]]:
    """The ``MCPServer`` and the holder of its session (``{"session": AgentSession | None}``)."""
    import anyio
    import anyio.to_thread
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    from agent.mcp_session import AgentSession, Interrupted, ToolInputError
    from sandbox.admission import TaskTooLarge
    from kernelloop import __version__

    server = MCPServer(name="kernelloop", version=__version__, instructions=INSTRUCTIONS, log_level="WARNING")
    holder: dict[str, Any] = {"session": None}
    lock = threading.Lock()

    def session_of(ctx: Context) -> AgentSession:
        with lock:
            if holder["session"] is None:
                name, version = _client(ctx)
                holder["session"] = AgentSession(store, name, version, options)
            return holder["session"]

    async def call(fn: Any, *args: Any) -> Any:
        try:
            return await anyio.to_thread.run_sync(lambda: fn(*args))
        except ToolInputError as exc:
            raise ToolError(str(exc)) from None

    @server.tool()
    async def list_tasks(ctx: Context, suite: str = "seeds") -> dict[str, Any]:
        """Tasks of a bundled suite (seeds, level1, level2, level3), a task directory (a KernelBench
        level folder) or a task file: name, path, the operations of forward, sizes and the sizes
        used on cpu."""
        tasks = await call(AgentSession.list_tasks, suite)
        return {"suite": suite, "count": len(tasks), "tasks": tasks}

    @server.tool()
    async def show_task(task: str, ctx: Context, device: Optional[str] = None) -> dict[str, Any]:
        """A task's reference source, its sizes on the device, the numerics conventions, and the
        baselines stored for it (eager, torch.compile, roofline floor)."""
        return await call(session_of(ctx).show_task, task, device)

    @server.tool()
    async def baseline(task: str, ctx: Context, device: Optional[str] = None, precision: Optional[str] = None,
                       measure: bool = False) -> dict[str, Any]:
        """The task's reference times: stored baselines, those this session's evaluations measured,
        and with measure=true the reference timed now (eager, torch.compile) and stored."""
        return await call(session_of(ctx).baseline, task, device, precision, measure)

    @server.tool()
    async def history(task: str, ctx: Context) -> dict[str, Any]:
        """This session's attempts on a task, best first (clean, then correct, then faster)."""
        rows = await call(session_of(ctx).history, task)
        return {"task": task, "attempts": rows}

    @server.tool()
    async def evaluate(task: str, source: str, ctx: Context, device: Optional[str] = None,
                       precision: Optional[str] = None, backend: Optional[str] = None) -> dict[str, Any]:
        """Build, check and time a candidate module (Python source defining class ModelNew) against
        a task, exactly as `kernelloop eval` does. device: cuda or cpu (default: cuda where a GPU is
        visible); precision: fp32, fp16 or bf16; backend: cuda (load_inline; C++ on cpu) or triton.
        Answers the verdict (status, flags), speedups over eager and torch.compile, the numerics,
        the roofline floor fraction and the grounded critic's analysis. Stored as an attempt."""
        session = session_of(ctx)
        job = await call(session.submit, task, source, device, precision, backend)
        events: "queue.Queue[str]" = queue.Queue()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["out"] = session.judge(job, events.put)
            except BaseException as exc:  # noqa: BLE001 - handed to the protocol's side below
                box["error"] = exc

        worker = threading.Thread(target=work, daemon=True, name=f"mcp-evaluate-{job.attempt_id}")
        worker.start()
        last: Optional[str] = None
        try:
            while worker.is_alive() or not events.empty():
                try:
                    stage = events.get_nowait()
                except queue.Empty:
                    await anyio.sleep(0.1)
                    continue
                if stage in STAGES and STAGES[stage][1] != last:
                    step, last = STAGES[stage]
                    await ctx.report_progress(step, STEPS, last)
        finally:
            if worker.is_alive():       # cancelled, or the client went away: no worker left behind
                with anyio.CancelScope(shield=True):
                    print(f"[kernelloop mcp] evaluation of attempt {job.attempt_id} stopped: its call was "
                          f"cancelled or its client went away; killing its workers", file=sys.stderr, flush=True)
                    await anyio.to_thread.run_sync(session.cancel, job, "the client cancelled the call")
                    await anyio.to_thread.run_sync(worker.join, 60)
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, Interrupted):
                raise ToolError(f"the evaluation was stopped before its verdict: {exc}")
            if isinstance(exc, TaskTooLarge):     # the task's status on this device, not the candidate's verdict
                raise ToolError(f"the task does not fit on this device (no verdict): {exc.reason}")
            raise ToolError(f"the harness failed, not the candidate: {type(exc).__name__}: {exc}")
        await ctx.report_progress(STEPS, STEPS, f"done: {box['out']['status']}")
        return box["out"]

    return server, holder


def mcp_command(db: Optional[str] = DbOption,
                trials: int = typer.Option(5, "--trials", min=1, help="trials per evaluation (as eval's)"),
                timed_runs: int = typer.Option(20, "--timed-runs", min=1, help="timed runs per evaluation (as eval's)"),
                no_compile: bool = typer.Option(False, "--no-compile",
                                                help="skip timing the reference under torch.compile")) -> None:
    """Serve the judge to a coding agent over MCP on stdio (list_tasks, show_task, evaluate,
    baseline, history); every evaluation is stored as an attempt of a run of kind agent."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        fail("kernelloop mcp needs the MCP SDK: pip install 'kernelloop[mcp]' (or pip install mcp)")
    import anyio

    from agent.mcp_session import SessionOptions

    store = open_store(db)
    server, holder = build_server(store, SessionOptions(trials=trials, timed_runs=timed_runs,
                                                        time_compile=not no_compile))

    async def serve() -> None:
        try:
            await server.run_stdio_async()
        finally:
            session = holder["session"]
            if session is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(session.close)

    try:
        anyio.run(serve)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 - the client's pipe closed under a last reply: it went away
        if not _only_pipe_errors(exc):
            raise
        print("[kernelloop mcp] the client went away (its pipe closed); session ended", file=sys.stderr, flush=True)
    finally:
        store.close()


def _only_pipe_errors(exc: BaseException) -> bool:
    """Whether ``exc`` (an exception group of the SDK's tasks, maybe nested) holds only errors of
    a pipe whose other end closed."""
    inner = getattr(exc, "exceptions", None)
    if inner is not None:
        return bool(inner) and all(_only_pipe_errors(e) for e in inner)
    return isinstance(exc, (BrokenPipeError, ConnectionResetError))
