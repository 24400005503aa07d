"""Record one coding-agent session with ``kernelloop mcp`` as a markdown transcript (docs/mcp.md's).

Starts ``kernelloop mcp`` through the MCP SDK's stdio client (as an agent CLI would), then calls
list_tasks, show_task, evaluate (an honest candidate and a cheating one, with their progress
notifications) and history, and prints every call and answer (long fields shortened).

    python3 scripts/mcp_transcript.py --device cpu --db /tmp/mcp_demo.db [--server-arg=--no-compile]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
TASK = "seeds/conv2d_divide_leakyrelu"
HONEST = FIX / "critic" / "{device}" / "fused_tail.py"  # conv in PyTorch, divide + LeakyReLU fused (C++ or CUDA)
CHEAT = FIX / "mcp" / "calls_reference_tail.py"         # appended to the task: calls the reference Model


def _short(value, limit: int = 400):
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"... [{len(value) - limit} more characters]"
    if isinstance(value, list):
        return [_short(v, limit) for v in value[:6]] + ([f"... [{len(value) - 6} more]"] if len(value) > 6 else [])
    if isinstance(value, dict):
        return {k: _short(v, limit) for k, v in value.items()}
    return value


async def main(args: argparse.Namespace) -> None:
    from mcp import ClientSession, StdioServerParameters, stdio_client
    from mcp.types import Implementation

    server = StdioServerParameters(command=sys.executable, args=["-m", "kernelloop", "mcp", *args.server_arg],
                                   env={"PYTHONPATH": str(ROOT), "KERNELLOOP_DB": args.db})
    out = sys.stdout

    def show(title: str, payload) -> None:
        out.write(f"\n**{title}**\n\n```json\n{json.dumps(_short(payload), indent=2, ensure_ascii=False)}\n```\n")

    async with stdio_client(server) as (r, w):
        async with ClientSession(r, w, client_info=Implementation(name="transcript-agent", version="1.0")) as s:
            init = await s.initialize()
            out.write(f"server: {init.server_info.name} {init.server_info.version}; "
                      f"tools: {', '.join(t.name for t in (await s.list_tools()).tools)}\n")

            async def call(name: str, arguments: dict, progress: bool = False):
                shown = {k: (v if k != "source" else _short(v, 120)) for k, v in arguments.items()}
                t0 = time.monotonic()
                notes: list[str] = []

                async def on_progress(p, total, message):
                    notes.append(f"[{time.monotonic() - t0:6.1f} s] progress {p:g}/{total:g}: {message}")

                res = await s.call_tool(name, arguments, progress_callback=on_progress if progress else None)
                show(f"→ {name}", shown)
                if notes:
                    out.write("\n```text\n" + "\n".join(notes) + "\n```\n")
                text = res.content[0].text
                show(f"← {name}" + (" (tool error)" if res.is_error else ""),
                     text if res.is_error else json.loads(text))

            await call("list_tasks", {"suite": "seeds"})
            await call("show_task", {"task": TASK, "device": args.device})
            await call("evaluate", {"task": TASK, "source": "class ModelNew(nn.Module:\n", "device": args.device})
            await call("evaluate", {"task": TASK, "source": Path(str(HONEST).format(device=args.device)).read_text(),
                                    "device": args.device}, progress=True)
            cheat = (ROOT / "tasks" / f"{TASK}.py").read_text() + CHEAT.read_text()
            await call("evaluate", {"task": TASK, "source": cheat, "device": args.device}, progress=True)
            await call("history", {"task": TASK})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--db", default="mcp_demo.db")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to kernelloop mcp (repeatable)")
    anyio.run(main, parser.parse_args())
