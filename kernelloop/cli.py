"""The ``kernelloop`` command: each command group is a typer sub-app of its own module."""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kernelloop: a model writes CUDA kernels for PyTorch models; a harness that "
                       "cannot be fooled judges them.")

# (module, attribute, command name, help); a Typer attribute becomes a sub-app, a function a command.
COMMANDS = [
    ("evals.tasks_cli", "app", "tasks", "List, show and check task files."),
    ("evals.baseline", "baseline_command", "baseline", "Time tasks' eager and torch.compile references; show roofline floors."),
    ("evals.device_cli", "app", "device", "Measure and show the device's bandwidth and FLOP ceilings."),
    ("sandbox.cli", "eval_command", "eval", "Build, check and time one candidate against its task."),
    ("agent.cli", "optimize_command", "optimize", "Run the optimisation loop over tasks."),
    ("agent.cli", "runs_command", "runs", "List runs in the store."),
    ("agent.cli", "show_command", "show", "Show a run's attempts and verdicts."),
    ("agent.logs_cli", "app", "logs", "Query stored model calls (prompts, responses, tokens, latency)."),
    ("agent.cli", "replay_command", "replay", "Re-evaluate a stored run's candidates on this machine."),
    ("agent.critic.cli", "critique_command", "critique", "Regenerate analyses from stored evidence."),
    ("evals.report_cli", "report_command", "report", "Write a run's analysis report (md, html, json)."),
    ("evals.report_cli", "export_command", "export", "Export a run's attempts as JSONL or seed-format documents."),
    ("evals.report_cli", "compare_command", "compare", "Compare two runs task by task."),
    ("agent.mcp_server", "mcp_command", "mcp", "Serve the judge to coding agents over MCP (stdio)."),
]


def _register() -> None:
    for module_name, attr, name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        obj = getattr(module, attr)
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name, help=help_text)
        else:
            app.command(name=name, help=help_text)(obj)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
