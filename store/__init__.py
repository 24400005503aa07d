"""The store: every task, baseline, run, model call, attempt, evaluation and analysis."""
from store.db import Store, StoreError, resolve_url
from store import models

__all__ = ["Store", "StoreError", "resolve_url", "models"]
