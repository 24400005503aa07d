"""Model backends; importing this package registers every one of them (see ``base.BACKENDS``)."""
import importlib

from agent.backends import openai_backend, replay_backend  # noqa: F401  (register openai:, replay:)

try:
    importlib.import_module("agent.backends.builtin_backend")  # registers builtin
except ImportError as _exc:
    # Only a checkout without the module is tolerated; an import error inside it is a bug to see.
    if getattr(_exc, "name", None) != "agent.backends.builtin_backend":
        raise
