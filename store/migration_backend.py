"""Migration ``m007_backend`` (a file of its own so that branches adding migrations merge easily:
it chains after whatever migration is last; frozen once released, as every migration is).

Every run says what its candidates were written in (``sandbox.backends``): ``cuda``, ``cpu`` or
``triton``. Runs from before backends existed built every candidate with ``load_inline`` for their
device: their backend is their device's name."""
from __future__ import annotations

import sqlalchemy as sa


def m007_backend(conn: sa.Connection) -> None:
    conn.execute(sa.text("ALTER TABLE runs ADD COLUMN backend VARCHAR(16)"))
    conn.execute(sa.text("UPDATE runs SET backend = device"))
